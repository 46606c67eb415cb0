"""The same model and prompts two ways: HF transformers `generate` (fp32, padded batch) and kvserve's
engine (no HTTP). Prints JSON with both throughputs and their ratio.

    python bench/compare_transformers.py [--batch 8] [--max-new-tokens 32]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import torch

from models import DEFAULT_MODEL, fetch, load_model
from server.config import EngineConfig
from server.engine.engine import Engine
from server.engine.sampling import SamplingParams
from server.engine.sequence import Finished

TOPICS = ["the sea", "a robot", "coffee", "the moon", "a small town", "trains", "winter", "music", "rivers", "chess"]


def prompts(tok, n: int) -> list[list[int]]:
    msgs = [[{"role": "user", "content": f"Write a few sentences about {TOPICS[i % len(TOPICS)]}."}] for i in range(n)]
    return [tok.encode(tok.apply_chat_template(m), add_special=False) for m in msgs]


def run_transformers(path, batch: list[list[int]], new_tokens: int) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    width = max(len(p) for p in batch)
    pad = 2
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    with torch.no_grad():
        model.generate(ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=2, do_sample=False, pad_token_id=pad)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=pad)
        elapsed = time.perf_counter() - start
    assert out.shape[1] - width == new_tokens
    return len(batch) * new_tokens / elapsed


def run_kvserve(model, batch: list[list[int]], new_tokens: int) -> float:
    async def go():
        engine = Engine(model, EngineConfig(max_batch_tokens=1024, max_running=len(batch)))
        engine.start()
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

        async def one(p):
            req = engine.submit(engine.create_session(None, None, None, persistent=False), p, params, resend=False)
            while not isinstance(await req.events.get(), Finished):
                pass
            return len(req.output_ids)

        await one(batch[0][:8])  # warm-up
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in batch))
        elapsed = time.perf_counter() - start
        await engine.stop()
        assert all(c == new_tokens for c in counts)
        return sum(counts) / elapsed

    return asyncio.run(go())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()
    model = load_model(DEFAULT_MODEL)
    batch = prompts(model.tokenizer, args.batch)
    ours = run_kvserve(model, batch, args.max_new_tokens)
    theirs = run_transformers(fetch(DEFAULT_MODEL, quiet=True), batch, args.max_new_tokens)
    print(json.dumps({"model": DEFAULT_MODEL, "batch": args.batch, "new_tokens": args.max_new_tokens,
                      "transformers_tok_s": round(theirs, 1), "kvserve_tok_s": round(ours, 1),
                      "ratio": round(ours / theirs, 2)}, indent=2))


if __name__ == "__main__":
    main()
