"""Random-weight GGUF files in the exact shapes of Qwen3-30B-A3B (Q4_K_M) and gpt-oss-20b (MXFP4), written
straight as blocks of the stored types: no float copy of a tensor, no F16 file, no quantizer. Prints JSON.

    python bench/moe_files.py qwen3-30b-a3b|gpt-oss-20b [--out PATH] [--layers N] [--experts N] [--vocab N]

The metadata is what llama.cpp's convert_hf_to_gguf.py writes for the real checkpoints (their config.json
values), then llama-quantize's general.file_type; each tensor has the type llama-quantize gives it
(src/llama-quant.cpp). The tensors are random_blocks.py's: random blocks whose values have an RMS of
1/sqrt(row length), so a forward pass stays finite through all the layers, generated and written a chunk
at a time, so the writer holds tens of MiB whatever the file's size. The tokenizer is moe_vocab.py's:
SmolLM2's byte-level BPE padded to the real vocabulary, the real model's special tokens at their ids,
its chat template.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# bench/ on the path only while its siblings import: importers of this module (tests) would otherwise find
# bench/kernels.py where transformers looks for the `kernels` package
_BENCH = str(ROOT / "bench")
_added = _BENCH not in sys.path
if _added:
    sys.path.insert(0, _BENCH)
try:
    from moe_vocab import GPT_OSS_SPECIALS, QWEN3_SPECIALS, add_vocabulary  # noqa: E402
    from random_blocks import TensorPlan, add_tensor_infos, write_tensor_data  # noqa: E402
finally:
    if _added:
        sys.path.remove(_BENCH)


@dataclass(frozen=True)
class MoeSpec:
    """One real checkpoint's shape and the GGUF facts its converted, quantized file holds."""

    arch: str  # GGUF general.architecture
    name: str
    basename: str
    size_label: str
    tags: tuple[str, ...]
    layers: int
    experts: int
    experts_used: int
    hidden: int
    ffn: int  # config.json intermediate_size, written as feed_forward_length
    expert_ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int
    rope_base: float
    rms_eps: float
    file_type: int  # llama_ftype: 15 MOSTLY_Q4_K_M, 38 MOSTLY_MXFP4_MOE
    pre_tokenizer: str
    template: str  # a file in llama.cpp's models/templates
    specials: tuple[tuple[int, str, int], ...]  # (id, text, token type)
    bos: int
    eos: int
    pad: int


QWEN3_30B_A3B = MoeSpec(
    arch="qwen3moe", name="Qwen3 30B A3B", basename="Qwen3", size_label="30B-A3B", tags=("text-generation",),
    layers=48, experts=128, experts_used=8, hidden=2048, ffn=6144, expert_ffn=768, heads=32, kv_heads=4,
    head_dim=128, vocab=151936, context=40960, rope_base=1e6, rms_eps=1e-6, file_type=15,
    pre_tokenizer="qwen2", template="Qwen-Qwen3-0.6B.jinja", specials=QWEN3_SPECIALS,
    bos=151643, eos=151645, pad=151643,
)
GPT_OSS_20B = MoeSpec(
    arch="gpt-oss", name="Gpt Oss 20b", basename="gpt-oss", size_label="20B", tags=("vllm", "text-generation"),
    layers=24, experts=32, experts_used=4, hidden=2880, ffn=2880, expert_ffn=2880, heads=64, kv_heads=8,
    head_dim=64, vocab=201088, context=131072, rope_base=150000.0, rms_eps=1e-5, file_type=38,
    pre_tokenizer="gpt-4o", template="openai-gpt-oss-120b.jinja", specials=GPT_OSS_SPECIALS,
    bos=199998, eos=200002, pad=199999,
)
SPECS = {"qwen3-30b-a3b": QWEN3_30B_A3B, "gpt-oss-20b": GPT_OSS_20B}
GPT_OSS_WINDOW = 128
GPT_OSS_YARN = dict(factor=32.0, original_context=4096, beta_fast=32.0, beta_slow=1.0)


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quantize's choice of the layers whose attn_v and ffn_down get Q6_K in Q4_K_M."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def matrix(name: str, shape: tuple[int, ...], gguf_type: str) -> TensorPlan:
    return TensorPlan(name, shape, gguf_type, std=1.0 / math.sqrt(shape[-1]))


def norm(name: str, dim: int) -> TensorPlan:
    return TensorPlan(name, (dim,), "F32", std=0.02, center=1.0)


def qwen3moe_tensors(s: MoeSpec) -> list[TensorPlan]:
    """Q4_K_M as llama-quantize makes it from the converter's file: Q4_K, Q6_K for output and for attn_v and
    ffn_down_exps on use_more_bits layers (128 experts: none of its 8-expert rules apply), F32 norms and
    router (llama-quantize never quantizes ffn_gate_inp)."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    plans = [matrix("token_embd.weight", (s.vocab, s.hidden), "Q4_K"), norm("output_norm.weight", s.hidden),
             matrix("output.weight", (s.vocab, s.hidden), "Q6_K")]
    for i in range(s.layers):
        more = "Q6_K" if use_more_bits(i, s.layers) else "Q4_K"
        plans += [
            norm(f"blk.{i}.attn_norm.weight", s.hidden),
            matrix(f"blk.{i}.attn_q.weight", (q, s.hidden), "Q4_K"),
            matrix(f"blk.{i}.attn_k.weight", (kv, s.hidden), "Q4_K"),
            matrix(f"blk.{i}.attn_v.weight", (kv, s.hidden), more),
            matrix(f"blk.{i}.attn_output.weight", (s.hidden, q), "Q4_K"),
            norm(f"blk.{i}.attn_q_norm.weight", s.head_dim),
            norm(f"blk.{i}.attn_k_norm.weight", s.head_dim),
            norm(f"blk.{i}.ffn_norm.weight", s.hidden),
            matrix(f"blk.{i}.ffn_gate_inp.weight", (s.experts, s.hidden), "F32"),
            matrix(f"blk.{i}.ffn_gate_exps.weight", (s.experts, s.expert_ffn, s.hidden), "Q4_K"),
            matrix(f"blk.{i}.ffn_up_exps.weight", (s.experts, s.expert_ffn, s.hidden), "Q4_K"),
            matrix(f"blk.{i}.ffn_down_exps.weight", (s.experts, s.hidden, s.expert_ffn), more),
        ]
    return plans


def gpt_oss_tensors(s: MoeSpec) -> list[TensorPlan]:
    """MXFP4_MOE as llama-quantize makes it (ggml-org's gpt-oss-20b file): the 3-D expert matrices MXFP4,
    every other matrix Q8_0 (token_embd and output too), the router and every 1-D or bias tensor F32 (the
    expert biases are 2-D but named .bias, which llama-quantize leaves alone)."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    plans = [matrix("token_embd.weight", (s.vocab, s.hidden), "Q8_0"), norm("output_norm.weight", s.hidden),
             matrix("output.weight", (s.vocab, s.hidden), "Q8_0")]

    def bias(name: str, *shape: int) -> TensorPlan:
        return TensorPlan(name, shape, "F32", std=0.02)

    for i in range(s.layers):
        b = f"blk.{i}"
        plans += [
            norm(f"{b}.attn_norm.weight", s.hidden),
            norm(f"{b}.post_attention_norm.weight", s.hidden),
            matrix(f"{b}.attn_q.weight", (q, s.hidden), "Q8_0"), bias(f"{b}.attn_q.bias", q),
            matrix(f"{b}.attn_k.weight", (kv, s.hidden), "Q8_0"), bias(f"{b}.attn_k.bias", kv),
            matrix(f"{b}.attn_v.weight", (kv, s.hidden), "Q8_0"), bias(f"{b}.attn_v.bias", kv),
            matrix(f"{b}.attn_output.weight", (s.hidden, q), "Q8_0"), bias(f"{b}.attn_output.bias", s.hidden),
            TensorPlan(f"{b}.attn_sinks.weight", (s.heads,), "F32", std=1.0),
            matrix(f"{b}.ffn_gate_inp.weight", (s.experts, s.hidden), "F32"), bias(f"{b}.ffn_gate_inp.bias", s.experts),
            matrix(f"{b}.ffn_gate_exps.weight", (s.experts, s.expert_ffn, s.hidden), "MXFP4"),
            bias(f"{b}.ffn_gate_exps.bias", s.experts, s.expert_ffn),
            matrix(f"{b}.ffn_up_exps.weight", (s.experts, s.expert_ffn, s.hidden), "MXFP4"),
            bias(f"{b}.ffn_up_exps.bias", s.experts, s.expert_ffn),
            matrix(f"{b}.ffn_down_exps.weight", (s.experts, s.hidden, s.expert_ffn), "MXFP4"),
            bias(f"{b}.ffn_down_exps.bias", s.experts, s.hidden),
        ]
    return plans


def tensor_plans(s: MoeSpec) -> list[TensorPlan]:
    """In llama-quantize's output order: by layer (the others first), then by name."""
    plans = qwen3moe_tensors(s) if s.arch == "qwen3moe" else gpt_oss_tensors(s)

    def order(p: TensorPlan) -> tuple[int, str]:
        return (int(p.name.split(".")[1]) if p.name.startswith("blk.") else -1, p.name)

    return sorted(plans, key=order)


def add_metadata(writer, s: MoeSpec) -> None:
    """general.* from the model card, the keys TextModel.set_gguf_parameters writes from config.json, and
    for gpt-oss GptOssModel's two more plus the YaRN rope scaling. gpt-oss's SwiGLU alpha (1.702) and
    limit (7.0) and its sliding/full alternation (sliding first) are constants in llama.cpp, not keys."""
    import gguf

    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(s.name)
    writer.add_basename(s.basename)
    writer.add_size_label(s.size_label)
    writer.add_license("apache-2.0")
    writer.add_tags(list(s.tags))
    writer.add_block_count(s.layers)
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.hidden)
    writer.add_feed_forward_length(s.ffn)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    if s.arch == "gpt-oss":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(GPT_OSS_YARN["factor"])
        writer.add_rope_scaling_orig_ctx_len(GPT_OSS_YARN["original_context"])
        writer.add_rope_scaling_yarn_beta_fast(GPT_OSS_YARN["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(GPT_OSS_YARN["beta_slow"])
    writer.add_rope_freq_base(s.rope_base)
    writer.add_layer_norm_rms_eps(s.rms_eps)
    writer.add_expert_count(s.experts)
    writer.add_expert_used_count(s.experts_used)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    if s.arch == "gpt-oss":
        writer.add_sliding_window(GPT_OSS_WINDOW)
    writer.add_expert_feed_forward_length(s.expert_ffn)


def write_moe_gguf(spec: MoeSpec, out: Path, *, layers: int | None = None, experts: int | None = None,
                   vocab: int | None = None, template: str | None = None, seed: int = 0) -> Path:
    """`spec`'s file at `out`, optionally shrunk to `layers`, `experts` (the experts used capped to them) and
    a `vocab` as small as the special tokens and a few hundred of SmolLM2's allow."""
    import gguf

    shrunk = dict(layers=layers, experts=experts, vocab=vocab)
    if any(v is not None and v < 1 for v in shrunk.values()):
        raise ValueError(f"layers, experts and vocab must be positive, got {shrunk}")
    s = replace(spec, **{k: v for k, v in shrunk.items() if v is not None})
    s = replace(s, experts_used=min(s.experts_used, s.experts), template=template or s.template)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp), s.arch)
    add_metadata(writer, s)
    add_vocabulary(writer, s, real_vocab=spec.vocab)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type(s.file_type)
    plans = tensor_plans(s)
    add_tensor_infos(writer, plans)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    write_tensor_data(writer, plans, seed)
    writer.close()
    tmp.replace(out)
    return out


def write_qwen3_30b_a3b(out: Path, **shrink) -> Path:
    """Qwen3-30B-A3B's shape in Q4_K_M (about 18.6 GB at the real size)."""
    return write_moe_gguf(QWEN3_30B_A3B, out, **shrink)


def write_gpt_oss_20b(out: Path, **shrink) -> Path:
    """gpt-oss-20b's shape in MXFP4 (about 12.1 GB at the real size)."""
    return write_moe_gguf(GPT_OSS_20B, out, **shrink)


SUFFIXES = {"qwen3-30b-a3b": "q4_k_m", "gpt-oss-20b": "mxfp4"}


def moe_file(name: str) -> Path:
    """The real-size file of `name` in the cache's bench-models folder, written the first time."""
    from models.catalog import cache_dir

    out = cache_dir() / "bench-models" / f"{name}-{SUFFIXES[name]}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        write_moe_gguf(SPECS[name], out.with_suffix(".tmp"))
        out.with_suffix(".tmp").rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=sorted(SPECS))
    ap.add_argument("--out", type=Path, help="default: <model>-<type>.gguf in the current folder")
    ap.add_argument("--layers", type=int, help="fewer layers, for a quick check")
    ap.add_argument("--experts", type=int, help="fewer experts, for a quick check")
    ap.add_argument("--vocab", type=int, help="a smaller vocabulary, for a quick check")
    ap.add_argument("--template", help="another chat template from llama.cpp's models/templates "
                                       "(Qwen3-Coder.jinja for Qwen3-Coder-30B-A3B's)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = args.out or Path(f"{args.model}-{SUFFIXES[args.model]}.gguf")
    started = time.perf_counter()
    write_moe_gguf(SPECS[args.model], out, layers=args.layers, experts=args.experts, vocab=args.vocab,
                   template=args.template, seed=args.seed)
    print(json.dumps({"path": str(out.resolve()), "bytes": out.stat().st_size,
                      "seconds": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
