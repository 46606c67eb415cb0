"""bench/moe_files.py's random-weight Qwen3-30B-A3B (Q4_K_M) and gpt-oss-20b (MXFP4) files, shrunk: read back
with gguf-py, their tensors, types, metadata, byte size and tokenizer are the real files' (at the real size
for what needs no writing: the tensor plan and the vocabulary)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from models.quant import model_kernels_available

from .spm_files import llama_server_binary, llama_server_client

ROOT = Path(__file__).resolve().parents[2]
# bench/ on the path only while its modules import each other: left there, its kernels.py would stand in
# for the `kernels` package transformers looks for, in every later test of this process
sys.path.insert(0, str(ROOT / "bench"))
try:
    import moe_files
    import moe_vocab
finally:
    sys.path.remove(str(ROOT / "bench"))

QWEN_SHRUNK = dict(layers=2, experts=4, vocab=1024)
OSS_SHRUNK = dict(layers=2, experts=2, vocab=2048)


@pytest.fixture(scope="module")
def written(tmp_path_factory, smollm_path):
    folder = tmp_path_factory.mktemp("moe")
    return {
        "qwen3": moe_files.write_qwen3_30b_a3b(folder / "qwen3.gguf", **QWEN_SHRUNK),
        "gpt-oss": moe_files.write_gpt_oss_20b(folder / "gpt-oss.gguf", **OSS_SHRUNK),
    }


def read(path: Path):
    import gguf

    return gguf.GGUFReader(str(path))


def expected_qwen3(layers: int, experts: int, vocab: int) -> dict[str, tuple[list[int], str]]:
    """name -> (ggml ne, type): the Q4_K_M mix llama-quantize gives Qwen3-MoE (2 layers: the second is
    one of use_more_bits', the 7/8 mark)."""
    h, q, kv, ff = 2048, 32 * 128, 4 * 128, 768
    out = {"token_embd.weight": ([h, vocab], "Q4_K"), "output.weight": ([h, vocab], "Q6_K"),
           "output_norm.weight": ([h], "F32")}
    for i in range(layers):
        more = "Q6_K" if i == 1 else "Q4_K"
        out |= {
            f"blk.{i}.attn_norm.weight": ([h], "F32"), f"blk.{i}.ffn_norm.weight": ([h], "F32"),
            f"blk.{i}.attn_q_norm.weight": ([128], "F32"), f"blk.{i}.attn_k_norm.weight": ([128], "F32"),
            f"blk.{i}.attn_q.weight": ([h, q], "Q4_K"), f"blk.{i}.attn_k.weight": ([h, kv], "Q4_K"),
            f"blk.{i}.attn_v.weight": ([h, kv], more), f"blk.{i}.attn_output.weight": ([q, h], "Q4_K"),
            f"blk.{i}.ffn_gate_inp.weight": ([h, experts], "F32"),
            f"blk.{i}.ffn_gate_exps.weight": ([h, ff, experts], "Q4_K"),
            f"blk.{i}.ffn_up_exps.weight": ([h, ff, experts], "Q4_K"),
            f"blk.{i}.ffn_down_exps.weight": ([ff, h, experts], more),
        }
    return out


def expected_gpt_oss(layers: int, experts: int, vocab: int) -> dict[str, tuple[list[int], str]]:
    h, q, kv, ff = 2880, 64 * 64, 8 * 64, 2880
    out = {"token_embd.weight": ([h, vocab], "Q8_0"), "output.weight": ([h, vocab], "Q8_0"),
           "output_norm.weight": ([h], "F32")}
    for i in range(layers):
        b = f"blk.{i}"
        out |= {
            f"{b}.attn_norm.weight": ([h], "F32"), f"{b}.post_attention_norm.weight": ([h], "F32"),
            f"{b}.attn_q.weight": ([h, q], "Q8_0"), f"{b}.attn_q.bias": ([q], "F32"),
            f"{b}.attn_k.weight": ([h, kv], "Q8_0"), f"{b}.attn_k.bias": ([kv], "F32"),
            f"{b}.attn_v.weight": ([h, kv], "Q8_0"), f"{b}.attn_v.bias": ([kv], "F32"),
            f"{b}.attn_output.weight": ([q, h], "Q8_0"), f"{b}.attn_output.bias": ([h], "F32"),
            f"{b}.attn_sinks.weight": ([64], "F32"),
            f"{b}.ffn_gate_inp.weight": ([h, experts], "F32"), f"{b}.ffn_gate_inp.bias": ([experts], "F32"),
            f"{b}.ffn_gate_exps.weight": ([h, ff, experts], "MXFP4"), f"{b}.ffn_gate_exps.bias": ([ff, experts], "F32"),
            f"{b}.ffn_up_exps.weight": ([h, ff, experts], "MXFP4"), f"{b}.ffn_up_exps.bias": ([ff, experts], "F32"),
            f"{b}.ffn_down_exps.weight": ([ff, h, experts], "MXFP4"), f"{b}.ffn_down_exps.bias": ([h, experts], "F32"),
        }
    return out


@pytest.mark.parametrize("model", ["qwen3", "gpt-oss"])
def test_tensors_have_the_real_names_shapes_and_types_and_the_file_their_size(written, model):
    import gguf

    reader = read(written[model])
    expected = expected_qwen3(**QWEN_SHRUNK) if model == "qwen3" else expected_gpt_oss(**OSS_SHRUNK)
    got = {t.name: ([int(n) for n in t.shape], t.tensor_type.name) for t in reader.tensors}
    assert got == expected
    names = [t.name for t in reader.tensors]
    assert names[:3] == ["output.weight", "output_norm.weight", "token_embd.weight"]  # llama-quantize's order

    def nbytes(ne: list[int], kind: str) -> int:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
        return int(np.prod(ne[1:])) * ne[0] // block * size

    data_start = min(t.data_offset for t in reader.tensors)
    padded = sum(-(-nbytes(ne, kind) // 32) * 32 for ne, kind in expected.values())
    assert written[model].stat().st_size == data_start + padded


@pytest.mark.parametrize("model", ["qwen3", "gpt-oss"])
def test_block_values_are_finite_and_scaled_to_the_row_length(written, model):
    import gguf

    reader = read(written[model])
    for t in reader.tensors:
        if t.name.startswith("blk.1.") and t.name.endswith(("_exps.weight", "attn_v.weight", "attn_output.weight")):
            values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
            rms = float(np.sqrt(np.mean(values**2)))
            assert np.isfinite(values).all()
            assert 0.8 < rms * np.sqrt(int(t.shape[0])) < 1.25, (t.name, rms)
            assert abs(values.mean()) < 0.1 * rms, t.name


def test_metadata_is_what_the_converter_and_llama_quantize_write(written):
    qwen = {k: f.contents() for k, f in read(written["qwen3"]).fields.items()}
    assert qwen["general.architecture"] == "qwen3moe" and qwen["general.file_type"] == 15
    assert qwen["general.quantization_version"] == 2
    assert {k: qwen[f"qwen3moe.{k}"] for k in (
        "block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
        "attention.head_count_kv", "expert_count", "expert_used_count", "attention.key_length",
        "attention.value_length", "expert_feed_forward_length")} == {
        "block_count": 2, "context_length": 40960, "embedding_length": 2048, "feed_forward_length": 6144,
        "attention.head_count": 32, "attention.head_count_kv": 4, "expert_count": 4, "expert_used_count": 4,
        "attention.key_length": 128, "attention.value_length": 128, "expert_feed_forward_length": 768}
    assert qwen["qwen3moe.rope.freq_base"] == 1e6
    assert qwen["qwen3moe.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)

    oss = {k: f.contents() for k, f in read(written["gpt-oss"]).fields.items()}
    assert oss["general.architecture"] == "gpt-oss" and oss["general.file_type"] == 38
    assert {k: oss[f"gpt-oss.{k}"] for k in (
        "block_count", "context_length", "embedding_length", "attention.head_count", "attention.head_count_kv",
        "expert_count", "expert_used_count", "attention.key_length", "attention.sliding_window",
        "expert_feed_forward_length", "rope.freq_base", "rope.scaling.type", "rope.scaling.factor",
        "rope.scaling.original_context_length")} == {
        "block_count": 2, "context_length": 131072, "embedding_length": 2880, "attention.head_count": 64,
        "attention.head_count_kv": 8, "expert_count": 2, "expert_used_count": 2, "attention.key_length": 64,
        "attention.sliding_window": 128, "expert_feed_forward_length": 2880, "rope.freq_base": 150000.0,
        "rope.scaling.type": "yarn", "rope.scaling.factor": 32.0, "rope.scaling.original_context_length": 4096}


@pytest.mark.parametrize("model, vocab, eos, template_tokens", [
    ("qwen3", 1024, "<|im_end|>", ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>")),
    ("gpt-oss", 2048, "<|return|>", ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")),
])
def test_the_tokenizer_has_the_vocabulary_size_and_the_templates_special_tokens(written, model, vocab, eos,
                                                                               template_tokens):
    fields = {k: f.contents() for k, f in read(written[model]).fields.items()}
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens) == len(fields["tokenizer.ggml.token_type"]) == vocab
    assert fields["tokenizer.ggml.model"] == "gpt2"
    assert tokens[fields["tokenizer.ggml.eos_token_id"]] == eos
    for text in template_tokens:
        assert tokens.count(text) == 1 and text in fields["tokenizer.chat_template"], text
    known = set(tokens)
    assert all(set(m.split(" ")) <= known for m in fields["tokenizer.ggml.merges"])


def test_the_qwen3_tokenizer_loads_and_keeps_chat_tokens_whole(written):
    from models.tokenizer import byte_level_bpe_from_gguf

    fields = {k: f.contents() for k, f in read(written["qwen3"]).fields.items()}
    tok = byte_level_bpe_from_gguf(fields)
    ids = tok.encode("<|im_start|>user\nthe<|im_end|><tool_call>", add_special_tokens=False).ids
    tokens = fields["tokenizer.ggml.tokens"]
    assert [tokens[i] for i in (ids[0], ids[-2], ids[-1])] == ["<|im_start|>", "<|im_end|>", "<tool_call>"]


def test_at_the_real_size_the_specials_sit_at_their_real_ids(smollm_path):
    base = moe_vocab.smollm_tokenizer()
    tokens, types, merges, shift = moe_vocab.vocabulary(moe_vocab.QWEN3_SPECIALS, 151936, 151936, base)
    assert shift == 0 and len(tokens) == 151936 and merges == base[2]
    assert (tokens[151643], tokens[151645], tokens[151667]) == ("<|endoftext|>", "<|im_end|>", "<think>")
    assert tokens.count("<|im_start|>") == 1 and tokens[1] != "<|im_start|>"  # SmolLM2's own moved aside
    assert tokens[17:49152] == base[0][17:]
    tokens, _, _, _ = moe_vocab.vocabulary(moe_vocab.GPT_OSS_SPECIALS, 201088, 201088, base)
    assert len(tokens) == 201088 and (tokens[200002], tokens[200006], tokens[201087]) == (
        "<|return|>", "<|start|>", "<|reserved_201087|>")


def test_the_real_size_plans_hold_the_published_files_tensor_counts_and_sizes():
    qwen = moe_files.tensor_plans(moe_files.QWEN3_30B_A3B)
    assert len(qwen) == 579 and 18.4e9 < sum(p.nbytes for p in qwen) < 18.7e9
    q6 = sorted(int(p.name.split(".")[1]) for p in qwen
                if p.name.endswith("ffn_down_exps.weight") and p.gguf_type == "Q6_K")
    assert q6 == [0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41, 42, 43, 44, 45, 46, 47]
    oss = moe_files.tensor_plans(moe_files.GPT_OSS_20B)
    assert len(oss) == 459 and 12.0e9 < sum(p.nbytes for p in oss) < 12.2e9


@pytest.mark.skipif(llama_server_binary() is None, reason="llama-server is not built (python bench/llama_server.py)")
@pytest.mark.parametrize("model, chat_tokens", [
    ("qwen3", ("<|im_start|>", "<|im_end|>", "<tool_call>", "<think>")),
    ("gpt-oss", ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")),
])
def test_llama_server_loads_the_file_tokenizes_its_specials_whole_and_generates(written, model, chat_tokens):
    tokens = read(written[model]).fields["tokenizer.ggml.tokens"].contents()
    with llama_server_client(llama_server_binary(), written[model], extra=("--jinja",)) as client:
        body = {"content": "".join(chat_tokens), "parse_special": True}
        ids = client.post("/tokenize", json=body).raise_for_status().json()["tokens"]
        assert [tokens[i] for i in ids] == list(chat_tokens)
        # the chat template renders (a random model's reply fails its format's parser, so generate raw)
        messages = {"messages": [{"role": "user", "content": "hi"}]}
        prompt = client.post("/apply-template", json=messages).raise_for_status().json()["prompt"]
        assert chat_tokens[0] in prompt and "hi" in prompt
        reply = client.post("/completion", json={"prompt": prompt, "n_predict": 8, "temperature": 0,
                                                 "ignore_eos": True}).raise_for_status().json()
        assert reply["tokens_predicted"] == 8


@pytest.mark.skipif(not model_kernels_available(), reason="the C++/AVX2 kernels are unavailable")
@pytest.mark.parametrize("model, held", [("qwen3", {"Q4_K", "Q6_K"}), ("gpt-oss", {"MXFP4", "Q8_0"})])
def test_kvserve_serves_the_shrunk_files_as_stored_and_batch_invariant(written, model, held):
    """The real widths, experts and formats: held as stored, and a prompt's greedy tokens the same alone and
    beside another, bitwise."""
    from models import load_model

    from .test_architectures import batched_greedy
    from .test_models import greedy

    ours = load_model(str(written[model]), weights="auto", use_cache=False)
    assert held <= {t for t, _ in ours.held}, ours.held
    prompts = [ours.tokenizer.encode("The quick brown fox jumps over the lazy dog."), ours.tokenizer.encode("Once upon")]
    alone = [greedy(ours.forward, ours.config, ids, 8) for ids in prompts]
    assert batched_greedy(ours.forward, ours.config, prompts, 8)[1] == alone


@pytest.mark.skipif(llama_server_binary() is None, reason="llama-server is not built (python bench/llama_server.py)")
def test_the_gpt_4o_pre_tokenizer_splits_as_llama_cpps(written):
    """gpt-oss's files name o200k's pre-tokenizer (gpt-4o): cased words, numbers by threes, apostrophes."""
    from models.gguf_loader import read_gguf

    from .spm_files import llama_cpp_tokenizer

    tokenizer = read_gguf(written["gpt-oss"])[2]
    text = "HTTPServer said: don't SHOUT 1234567 times!\n\n  Ünïcode çafé <|start|>user<|message|>hi"
    with llama_cpp_tokenizer(llama_server_binary(), written["gpt-oss"]) as theirs:
        assert tokenizer.encode(text, add_special=False) == theirs(text)
