import json
import subprocess
import sys
import textwrap

import pytest
import torch

from kvcache import REGISTRY, CacheConfig, SessionCache, Sizing
from models import DEFAULT_MODEL, ModelLoadError, UnsupportedModel, load_model
from models.detokenizer import IncrementalDetokenizer
from models.export import build_model, export_program
from models.gguf_loader import read_gguf
from models.loader import export_checkpoint

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away,"
NO_ROWS = torch.zeros(0, dtype=torch.long)  # no hidden rows: the program's embedding output stays empty


class Session:
    """A registry cache for one test sequence."""

    counter = 0

    def __init__(self, config, capacity=256, sizing=Sizing.DYNAMIC):
        Session.counter += 1
        self.key = f"test-{Session.counter}"
        REGISTRY.install(self.key, SessionCache(CacheConfig(config.n_layers, config.n_kv_heads, config.head_dim, capacity, sizing=sizing)))

    def __enter__(self):
        self.step = REGISTRY.set_active(self.key)
        return self

    def __exit__(self, *exc):
        REGISTRY.uninstall(self.key)

    def committing(self, forward):
        """`forward`, each call of which extends this session's cache (committed once it has run)."""
        def run(*args):
            out = forward(*args)
            self.step.commit()
            return out
        return run


def run_prompt(forward, config, ids, chunks=None, all_logits=False):
    """Prefill ids (whole or in chunks) -> logits of the last token, or of every token."""
    chunks = chunks or [len(ids)]
    outs, at = [], 0
    for n in chunks:
        rows = torch.arange(n) if all_logits else torch.tensor([n - 1])
        outs.append(forward(torch.tensor([ids[at : at + n]]), torch.arange(at, at + n).unsqueeze(1), rows, NO_ROWS)[0])
        at += n
    return torch.cat(outs) if all_logits else outs[-1]


def greedy(forward, config, ids, n, chunks=None, capacity=256):
    with Session(config, capacity) as session, torch.no_grad():
        forward = session.committing(forward)
        logits = run_prompt(forward, config, ids, chunks)
        out = []
        for i in range(n):
            t = int(logits[-1].argmax())
            out.append(t)
            logits, _ = forward(torch.tensor([[t]]), torch.tensor([[len(ids) + i]]), torch.tensor([0]), NO_ROWS)
    return out


def hf_greedy(hf, ids, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "tied"])
def test_tiny_checkpoints_match_transformers(tiny_checkpoints, smollm, kind):
    import transformers

    folder = tiny_checkpoints[kind]
    program, config, tok, _ = export_checkpoint(folder, torch.float32)
    fwd = program.module()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tok.encode(PROMPT)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    for chunks in (None, [5, 7, len(ids) - 12]):
        with Session(config) as session, torch.no_grad():
            ours = run_prompt(session.committing(fwd), config, ids, chunks, all_logits=True)
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    expected = hf_greedy(hf, ids, 20)
    assert greedy(fwd, config, ids, 20) == expected
    assert greedy(fwd, config, ids, 20, chunks=[3, 9, len(ids) - 12]) == expected
    if kind == "tied":
        assert config.tie_embeddings
    if kind == "qwen2":
        assert config.qkv_bias


@pytest.fixture(scope="module")
def hf_smollm(smollm_path):
    import transformers

    kw = dict(gguf_file=smollm_path.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm_path.parent, dtype=torch.float32, **kw).eval()
    tok = transformers.AutoTokenizer.from_pretrained(smollm_path.parent, **kw)
    return hf, tok


def test_smollm_gguf_matches_transformers(smollm, hf_smollm):
    hf, hf_tok = hf_smollm
    tok, config = smollm.tokenizer, smollm.config
    assert (config.n_layers, config.dim, config.n_heads, config.n_kv_heads, config.head_dim) == (30, 576, 9, 3, 64)
    assert (config.vocab_size, config.rope_theta, config.tie_embeddings) == (49152, 100000.0, True)
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    text = tok.apply_chat_template(messages)
    assert text == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special=False)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    with Session(config) as session, torch.no_grad():
        ours = run_prompt(session.committing(smollm.forward), config, ids, all_logits=True)
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=0)
    assert greedy(smollm.forward, config, ids, 32) == hf_greedy(hf, ids, 32)


STRINGS = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Emoji: 🤗🚀👩‍👩‍👧 done 😀!",
    "東京は日本の首都です。中文字符和한국어",
    "tabs\t\tand   spaces    and\n\n\nnewlines  \n ",
    "In 2024, 12345 items cost $3.50 (≈ €3.20).",
    "<|im_start|>user\nhello<|im_end|>",
    "   leading spaces and trailing   ",
]


def test_smollm_tokenizer_matches_transformers(smollm, hf_smollm):
    _, hf_tok = hf_smollm
    for s in STRINGS:
        ours = smollm.tokenizer.encode(s)
        assert ours == hf_tok.encode(s, add_special_tokens=False), s
        assert smollm.tokenizer.decode(ours, skip_special=False) == s


@pytest.mark.parametrize("text", [STRINGS[1], STRINGS[2], "mixed 日本 🤗 text é ñ ü 🇫🇷 end"])
def test_incremental_detokenizer_never_breaks_characters(smollm, text):
    tok = smollm.tokenizer
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)
    assert any(p == "" for p in pieces), "some multi-byte character should have been held back"


def test_a_cached_export_is_named_as_it_is_asked_for(smollm_path):
    """One file asked for by its path and by its catalog name shares one cached export, and each load carries
    the name it was asked by (what a server then serves), not the one the export was first made under."""
    by_path, by_name = load_model(str(smollm_path)), load_model(DEFAULT_MODEL)
    assert by_path.folder == by_name.folder
    assert (by_path.name, by_name.name) == (str(smollm_path), DEFAULT_MODEL)


def test_a_new_export_removes_the_same_checkpoints_stale_ones(tiny_checkpoints, tmp_path):
    """Exporting a checkpoint again (new kvserve code, or the file changed) removes its earlier artifacts of
    the same options once unused for an hour (each is as large as the model); a recently used one, which
    another kvserve version may be running from, and those of other options or checkpoints stay."""
    import os
    import shutil
    import time

    from models.catalog import cache_dir
    from models.export import activations_for

    folder = tmp_path / "copy"
    shutil.copytree(tiny_checkpoints["llama"], folder)  # a path no export was made from
    source = str(folder.resolve())
    same = {"source": source, "dtype": "float32", "weights": "f32", "activations": activations_for("f32", "int8")}
    planted = {"stale": same, "recent": same, "other-weights": {**same, "weights": "f16"},
               "other-file": {**same, "source": source + "-elsewhere"}}
    root = cache_dir() / "artifacts"
    paths = {}
    for name, meta in planted.items():
        paths[name] = root / f"test-{name}-{os.getpid()}"
        paths[name].mkdir(parents=True)
        (paths[name] / "kvserve.json").write_text(json.dumps(meta))
        if name != "recent":
            os.utime(paths[name], (time.time() - 7200, time.time() - 7200))
    model = None
    try:
        model = load_model(str(folder), weights="f32")
        assert json.loads((model.folder / "kvserve.json").read_text())["source"] == source
        assert {name for name, p in paths.items() if p.exists()} == {"recent", "other-weights", "other-file"}
        assert model.folder.is_dir()
    finally:
        for p in [*paths.values(), *([model.folder] if model else [])]:
            shutil.rmtree(p, ignore_errors=True)


def test_artifact_loads_in_fresh_process(tiny_checkpoints, tmp_path):
    out = tmp_path / "artifact"
    folder = tiny_checkpoints["llama"]
    done = subprocess.run([sys.executable, "-m", "server.cli", "export", "--model", str(folder), "--weights", "f32", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert {p.name for p in out.iterdir()} == {"program.py", "weights.safetensors", "config.json", "tokenizer.json", "tokenizer_meta.json", "kvserve.json"}
    model = load_model(str(folder), use_cache=False)
    ids = model.tokenizer.encode(PROMPT)
    with Session(model.config) as session, torch.no_grad():
        ref = run_prompt(session.committing(model.forward), model.config, ids, all_logits=True)
    torch.save({"ids": ids, "ref": ref}, tmp_path / "ref.pt")
    script = textwrap.dedent(f"""
        import torch
        from models import load_model
        from kvcache import REGISTRY, CacheConfig, SessionCache
        m = load_model({str(out)!r})
        d = torch.load({str(tmp_path / "ref.pt")!r})
        c = m.config
        REGISTRY.install("s", SessionCache(CacheConfig(c.n_layers, c.n_kv_heads, c.head_dim, 300)))
        n = len(d["ids"])
        with REGISTRY.active("s"):
            got, _ = m.forward(torch.tensor([d["ids"]]), torch.arange(n).unsqueeze(1), torch.arange(n), torch.arange(0))
        assert torch.equal(got, d["ref"]), (got - d["ref"]).abs().max()
        print("identical")
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "identical"


def test_corrupt_and_truncated_gguf_fail_clearly(smollm_path, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOTAGGUF" + b"\0" * 100)
    with pytest.raises(ModelLoadError, match="not a valid GGUF"):
        read_gguf(bad)
    cut = tmp_path / "cut.gguf"
    with open(smollm_path, "rb") as src:
        cut.write_bytes(src.read(20_000_000))
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        read_gguf(cut)


def test_folder_without_config_and_unsupported_arch(tmp_path, tiny_checkpoints):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(empty), use_cache=False)
    odd = tmp_path / "odd"
    odd.mkdir()
    cfg = json.loads((tiny_checkpoints["llama"] / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (odd / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModel, match="MambaForCausalLM"):
        load_model(str(odd), use_cache=False)
    with pytest.raises(ModelLoadError, match="neither a named model"):
        load_model("no-such-model")


@pytest.mark.parametrize("weights", ["f32", "stored"])
def test_exported_smollm_graph_holds_no_cache(smollm_path, weights):
    """The default export too (its weights as stored, block-format layers as native ops): one attention op a
    layer, and no buffer but the weights and the RoPE frequencies."""
    config, state, _ = read_gguf(smollm_path)
    ep = export_program(build_model(config, state, torch.float32, weights))
    buffers = [s.target for s in ep.graph_signature.input_specs if s.kind.name == "BUFFER"]
    assert all(b == "inv_freq" or b.split(".")[-1].startswith("packed") for b in buffers), buffers
    assert not [s for s in ep.graph_signature.output_specs if s.kind.name == "BUFFER_MUTATION"]
    calls = [n for n in ep.graph.nodes if "update_and_attend" in str(n.target)]
    assert len(calls) == 30
