"""GGUF files written by the tests and benchmarks with gguf-py: a Llama of any shape, SmolLM2's tokenizer,
each matrix in the block format asked for, as random blocks of sane scale (no quantizer needed)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

LLAMA_CPP_PYTHON = "0.3.36"  # the llama-cpp-python sdist whose vendored llama.cpp is compared with and used

# Where each format keeps its fp16 scale fields in a block, and a bound on their values that gives weights
# of a few hundredths: the rest of a block's bytes may be anything.
SCALE_FIELDS = {
    "Q4_0": ((0,), 0.01), "Q4_1": ((0, 2), 0.01), "Q5_0": ((0,), 0.005), "Q5_1": ((0, 2), 0.005),
    "Q8_0": ((0,), 0.0005), "Q4_K": ((0, 2), 2e-4), "Q5_K": ((0, 2), 1e-4), "Q6_K": ((208,), 5e-5),
    "Q2_K": ((80, 82), 5e-4),
}
# MXFP4's scale is an E8M0 exponent byte e (2^(e - 128)) at byte 0: the range of e that gives such weights
EXPONENT_FIELDS = {"MXFP4": (0, range(118, 122))}


def random_blocks(gguf_type: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, row bytes] uint8 of random blocks of `gguf_type`, their scales bounded."""
    import gguf

    qtype = gguf.GGMLQuantizationType[gguf_type]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, k // block, size), dtype=np.uint8)
    if gguf_type in EXPONENT_FIELDS:
        at, exponents = EXPONENT_FIELDS[gguf_type]
        raw[..., at] = rng.integers(exponents.start, exponents.stop, size=raw.shape[:2], dtype=np.uint8)
        return raw.reshape(rows, -1)
    offsets, bound = SCALE_FIELDS[gguf_type]
    for at in offsets:
        values = rng.uniform(-bound, bound, size=raw.shape[:2]).astype(np.float16)
        raw[..., at : at + 2] = values.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def matrix(gguf_type: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    if gguf_type == "F32":
        return (rng.standard_normal((rows, k)) * 0.05).astype(np.float32)
    if gguf_type == "F16":
        return (rng.standard_normal((rows, k)) * 0.05).astype(np.float16)
    return random_blocks(gguf_type, rows, k, rng)


def llama_writer(path: Path, tokenizer_gguf: Path, *, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn: int,
                 context: int, rope_base: float = 100000.0, rms_eps: float = 1e-5, name: str | None = None) -> tuple:
    """A gguf-py writer at `path` holding a Llama's shape and SmolLM2's tokenizer (copied from
    `tokenizer_gguf`), named `name` (the file's stem by default), for its tensors to be added; and the
    tokenizer's vocabulary size."""
    import gguf

    source = gguf.GGUFReader(str(tokenizer_gguf))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name or path.stem)
    writer.add_block_count(n_layers)
    writer.add_context_length(context)
    writer.add_embedding_length(dim)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv_heads)
    writer.add_rope_dimension_count(dim // n_heads)
    writer.add_rope_freq_base(rope_base)
    writer.add_layer_norm_rms_eps(rms_eps)
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
    writer.add_vocab_size(vocab)
    for name, field in source.fields.items():
        if name.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(name, field.contents(), field.types[0], sub)
    return writer, vocab


def write_llama_gguf(path: Path, tokenizer_gguf: Path, *, dim: int, n_layers: int, n_heads: int, n_kv_heads: int,
                     ffn: int, types: dict[str, str] | str, seed: int = 0, tied: bool = True, context: int = 2048) -> Path:
    """A Llama GGUF with SmolLM2's tokenizer (copied from `tokenizer_gguf`). `types`: one GGUF type for
    every matrix, or a type by tensor kind ("token_embd", "output", "attn_q", ..., "*" for the rest)."""
    import gguf

    rng = np.random.default_rng(seed)
    head_dim = dim // n_heads
    writer, vocab = llama_writer(path, tokenizer_gguf, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                 ffn=ffn, context=context)

    def kind_type(kind: str) -> str:
        return types if isinstance(types, str) else types.get(kind, types["*"])

    def add(name: str, kind: str, rows: int, k: int) -> None:
        t = kind_type(kind)
        raw_dtype = None if t in ("F32", "F16") else gguf.GGMLQuantizationType[t]
        writer.add_tensor(name, matrix(t, rows, k, rng), raw_dtype=raw_dtype)

    add("token_embd.weight", "token_embd", vocab, dim)
    writer.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32))
    if not tied:
        add("output.weight", "output", vocab, dim)
    for i in range(n_layers):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32))
        add(f"blk.{i}.attn_q.weight", "attn_q", dim, dim)
        add(f"blk.{i}.attn_k.weight", "attn_k", n_kv_heads * head_dim, dim)
        add(f"blk.{i}.attn_v.weight", "attn_v", n_kv_heads * head_dim, dim)
        add(f"blk.{i}.attn_output.weight", "attn_output", dim, dim)
        add(f"blk.{i}.ffn_gate.weight", "ffn_gate", ffn, dim)
        add(f"blk.{i}.ffn_up.weight", "ffn_up", ffn, dim)
        add(f"blk.{i}.ffn_down.weight", "ffn_down", dim, ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_cpp_source() -> Path:
    """llama.cpp's tree as the llama-cpp-python sdist vendors it (convert_hf_to_gguf.py, gguf-py, the C++
    sources), downloaded and unpacked once into the cache folder (bench/llama_server.py builds it there)."""
    from models.catalog import cache_dir

    tree = cache_dir() / "llama-server" / LLAMA_CPP_PYTHON / "llama.cpp"
    if (tree / "convert_hf_to_gguf.py").is_file():
        return tree
    with tempfile.TemporaryDirectory(prefix="kvserve-llama-") as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", tmp], check=True, capture_output=True)
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        tree.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tree, ignore_errors=True)
        shutil.move(str(next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))), tree)
    return tree


def rewritten(source: Path, out: Path, drop: tuple[str, ...] = (), fields: dict | None = None) -> Path:
    """`source` written again, without the tensors named in `drop`, its string fields in `fields` replaced
    (such as general.architecture): the damaged files a user may have."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    fields = fields or {}
    writer = gguf.GGUFWriter(str(out), fields.get("general.architecture", reader.fields["general.architecture"].contents()))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name in fields:
            writer.add_string(name, fields[name])
        else:
            writer.add_key_value(name, field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        if t.name not in drop:
            quantized = t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type if quantized else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def requantized_copy(source: Path, out: Path, gguf_type: str, quantize: Path) -> Path:
    """`source` as another GGUF type, the way a user makes one: every tensor written back as F16 (norms as
    F32) with gguf-py, then llama.cpp's llama-quantize (the binary at `quantize`) to `gguf_type`."""
    import gguf

    if out.is_file():
        return out
    reader = gguf.GGUFReader(str(source))
    f16 = out.with_name(out.stem + ".F16.tmp")
    writer = gguf.GGUFWriter(str(f16), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        writer.add_key_value(name, field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        writer.add_tensor(t.name, values.astype(np.float16 if values.ndim > 1 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp = out.with_suffix(".tmp")
    subprocess.run([str(quantize), str(f16), str(tmp), gguf_type, "2"], check=True, capture_output=True)
    tmp.rename(out)
    f16.unlink()
    return out
