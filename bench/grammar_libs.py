"""llguidance against xgrammar on one of the test suite's JSON schemas, with SmolLM2's tokenizer.

    python bench/grammar_libs.py --library llguidance --tokenizer tokenizer.json --text '{"name": ...}'
    python bench/grammar_libs.py --library xgrammar ...     # in an environment with xgrammar and transformers

Prints JSON: the time to build the tokenizer view, to compile the schema, and to compute each next-token
mask while the tokens of --text are consumed (median, mean, max). This is how kvserve chose llguidance.
"""
import argparse
import json
import statistics
import time

import numpy as np

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role", "address", "tags"], "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "editor", "viewer"]},
    "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"], "properties": {
        "city": {"type": "string", "maxLength": 24}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3}}}
TEXT = '{"name": "Mara Kara", "age": 25, "role": "editor", "address": {"city": "New York", "zip": "10121"}, "tags": ["a", "bb"]}'


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--library", choices=["llguidance", "xgrammar"], required=True)
    ap.add_argument("--tokenizer", required=True, help="a tokenizer.json")
    ap.add_argument("--text", default=TEXT, help="a reply that matches the schema")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(args.tokenizer).encode(args.text, add_special_tokens=False).ids
    if args.library == "llguidance":
        import llguidance

        t = time.perf_counter()
        tok = llguidance.LLTokenizer(open(args.tokenizer).read())
        tokenizer_s = time.perf_counter() - t
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            SCHEMA, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        t = time.perf_counter()
        matcher = llguidance.LLMatcher(tok, grammar)
        compile_s = time.perf_counter() - t
        bits = np.zeros((tok.vocab_size + 31) // 32, dtype=np.int32)

        def mask():
            matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)

        consume = matcher.consume_token
    else:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        t = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_file=args.tokenizer))
        compiler = xgr.GrammarCompiler(info)
        tokenizer_s = time.perf_counter() - t
        t = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
        compile_s = time.perf_counter() - t
        matcher = xgr.GrammarMatcher(compiled)
        bits = xgr.allocate_token_bitmask(1, info.vocab_size)

        def mask():
            matcher.fill_next_token_bitmask(bits)

        consume = matcher.accept_token
    times = []
    for token in ids:
        t = time.perf_counter()
        mask()
        times.append(time.perf_counter() - t)
        assert consume(token), f"the grammar refused token {token}"
    print(json.dumps({"library": args.library, "tokenizer_s": round(tokenizer_s, 3), "compile_ms": round(compile_s * 1e3, 2),
                      "tokens": len(ids), "mask_us_median": round(statistics.median(times) * 1e6, 1),
                      "mask_us_mean": round(statistics.fmean(times) * 1e6, 1), "mask_us_max": round(max(times) * 1e6, 1)}))


if __name__ == "__main__":
    main()
