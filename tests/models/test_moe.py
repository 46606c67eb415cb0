"""Mixture-of-experts decoders against transformers: tiny random Qwen3-MoE checkpoints that transformers
writes, loaded by kvserve from the folder and from llama.cpp's conversion of it, in every weight mode, with
the expert step one op a layer whose rows never depend on one another."""
import json
import shutil

import pytest
import torch

from models import load_model
from models.gguf_config import from_gguf_metadata
from models.export import build_model
from models.hf_loader import read_hf
from models.quant import model_kernels_available

from .test_architectures import OTHER_PROMPT, batched_greedy, matches_transformers, save_checkpoint, write_gguf_from_hf
from .spm_files import llama_cpp_greedy, llama_server_binary
from .test_models import PROMPT, Session, greedy, hf_greedy, run_prompt

N_EXPERTS, TOP_K = 8, 2
GPT_OSS_WINDOW = 6
needs_kernels = pytest.mark.skipif(not model_kernels_available(), reason="the C++/AVX2 kernels are unavailable")


def write_moe_checkpoint(folder, arch: str, tokenizer_source, seed: int = 0, norm_topk_prob: bool = True):
    """A random transformers MoE checkpoint, 3 layers with GQA, 8 experts of which each token uses 2, plus
    SmolLM2's tokenizer; norm weights random too, so a norm in the wrong place shows."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=tokenizer_source.vocab_size, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1,
                  eos_token_id=2, pad_token_id=None, rope_theta=10000.0, tie_word_embeddings=False)
    if arch == "qwen3moe":
        cfg = transformers.Qwen3MoeConfig(**common, head_dim=32, intermediate_size=128, moe_intermediate_size=32,
                                          num_experts=N_EXPERTS, num_experts_per_tok=TOP_K,
                                          norm_topk_prob=norm_topk_prob)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif arch == "gpt-oss":
        # YaRN over an original context of 64, a window of 6: both test prompts pass it
        rope = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 64, "rope_theta": 10000.0}
        cfg = transformers.GptOssConfig(**{**common, "max_position_embeddings": 512}, head_dim=16, intermediate_size=32,
                                        num_local_experts=N_EXPERTS, num_experts_per_tok=TOP_K, sliding_window=GPT_OSS_WINDOW,
                                        rope_parameters=rope, attention_bias=True)
        model = transformers.GptOssForCausalLM(cfg)
    else:
        raise ValueError(arch)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif ("gate" in name or "router" in name) and "experts" not in name and p.dim() == 2:
                p.normal_(0.0, 0.5)  # a router whose choices differ from token to token
            elif "bias" in name or "sinks" in name:
                p.normal_(0.0, 0.5)  # transformers starts biases at zero: random ones show where they go
    return save_checkpoint(model, folder, tokenizer_source)


@pytest.fixture(scope="module")
def moe_folders(tmp_path_factory, smollm):
    root = tmp_path_factory.mktemp("moe")
    return {"qwen3moe": write_moe_checkpoint(root / "qwen3moe", "qwen3moe", smollm.tokenizer, seed=5),
            "qwen3moe-softmax": write_moe_checkpoint(root / "qwen3moe-softmax", "qwen3moe", smollm.tokenizer, seed=6,
                                                     norm_topk_prob=False),
            "gpt-oss": write_moe_checkpoint(root / "gpt-oss", "gpt-oss", smollm.tokenizer, seed=7)}


@pytest.fixture(scope="module")
def hf_models(moe_folders):
    import transformers

    return {name: transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            for name, folder in moe_folders.items()}


ROUTING = {"qwen3moe": "softmax_norm", "qwen3moe-softmax": "softmax", "gpt-oss": "topk_softmax"}


@pytest.mark.parametrize("name", ["qwen3moe", "qwen3moe-softmax", "gpt-oss"])
def test_moe_folder_matches_transformers(moe_folders, hf_models, name):
    model = load_model(str(moe_folders[name]), weights="f32", use_cache=False)
    config = model.config
    assert (config.architecture, config.n_experts, config.n_experts_used, config.expert_ffn_dim) == (name.split("-s")[0], 8, 2, 32)
    assert config.routing == ROUTING[name]
    if name == "gpt-oss":
        assert config.layer_windows == (GPT_OSS_WINDOW, 0, GPT_OSS_WINDOW) and config.rope_scaling.kind == "yarn"
        assert (config.swiglu_limit, config.swiglu_alpha) == (7.0, 1.702)
    ids = model.tokenizer.encode(PROMPT)
    matches_transformers(model, hf_models[name], ids, [None, [5, 7, len(ids) - 12]])
    graph = model.forward.module.graph
    assert sum("moe_experts" in str(n.target) for n in graph.nodes) == config.n_layers
    assert sum("update_and_attend" in str(n.target) for n in graph.nodes) == config.n_layers


@pytest.mark.parametrize("name", ["qwen3moe", "gpt-oss"])
def test_llama_cpp_conversion_matches_transformers(moe_folders, hf_models, name, tmp_path):
    """llama.cpp's converter writes the experts as one 3-D tensor a projection (gpt-oss's gate and up
    de-interleaved, its biases and sinks beside them); the file reads as the folder. llama.cpp rounds YaRN's
    range, so gpt-oss's file is compared with transformers on the same folder told to round it too."""
    folder = moe_folders[name]
    hf = hf_models[name]
    if name == "gpt-oss":
        import transformers

        folder = tmp_path / "rounded"
        shutil.copytree(moe_folders[name], folder)
        cfg = json.loads((folder / "config.json").read_text())
        cfg["rope_parameters"]["truncate"] = True
        (folder / "config.json").write_text(json.dumps(cfg))
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    path = write_gguf_from_hf(folder, tmp_path / f"{name}.gguf")
    ours = load_model(str(path), weights="f32", use_cache=False)
    folder_config = read_hf(folder)[0]
    for field in ("architecture", "n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "n_experts", "n_experts_used",
                  "expert_ffn_dim", "routing", "layer_windows", "rope_scaling", "qkv_bias", "swiglu_limit"):
        assert getattr(ours.config, field) == getattr(folder_config, field), field
    assert ours.config.rope_attn_factor == pytest.approx(folder_config.rope_attn_factor)
    ids = ours.tokenizer.encode(PROMPT)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    with Session(ours.config) as session, torch.no_grad():
        got = run_prompt(session.committing(ours.forward), ours.config, ids, all_logits=True)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    assert greedy(ours.forward, ours.config, ids, 16) == hf_greedy(hf, ids, 16)


@needs_kernels
@pytest.mark.skipif(llama_server_binary() is None, reason="llama-server is not built (python bench/llama_server.py)")
@pytest.mark.parametrize("name", ["qwen3moe", "gpt-oss"])
def test_f16_files_give_llama_servers_greedy_tokens(moe_folders, name, tmp_path):
    """The same F16 file in both: 32 greedy tokens of each of two prompts, as stored on our side."""
    path = write_gguf_from_hf(moe_folders[name], tmp_path / f"{name}.f16.gguf", outtype="f16")
    ours = load_model(str(path), weights="stored", use_cache=False)
    prompts = [ours.tokenizer.encode(PROMPT), ours.tokenizer.encode(OTHER_PROMPT)]
    with llama_cpp_greedy(llama_server_binary(), path) as theirs:
        for ids in prompts:
            assert greedy(ours.forward, ours.config, ids, 32) == theirs(ids, 32)


@needs_kernels
@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_stored_experts_are_held_as_the_file_holds_them(moe_folders, tmp_path, outtype):
    """The experts of an F16 or Q8_0 file are held in that type (F16 tensors, or Q8_0 panels), and the
    greedy tokens of one prompt are the same alone and beside another, bitwise."""
    path = write_gguf_from_hf(moe_folders["qwen3moe"], tmp_path / f"q.{outtype}.gguf", outtype=outtype)
    model = load_model(str(path), weights="stored", use_cache=False)
    held = dict(model.held)
    assert held.get(outtype.upper(), 0) >= 3 * model.config.n_layers, model.held
    ids = model.tokenizer.encode(PROMPT)
    alone = greedy(model.forward, model.config, ids, 12)
    other = model.tokenizer.encode(OTHER_PROMPT)
    first, together = batched_greedy(model.forward, model.config, [ids, other], 12)
    assert together[0] == alone
    assert together[1] == greedy(model.forward, model.config, other, 12)


@needs_kernels
@pytest.mark.parametrize("weights", ["q8_0", "q4_0", "f16"])
def test_requantized_experts_follow_the_float_model(moe_folders, weights):
    """Each weight mode requantizes the experts too: its logits stay near the float model's."""
    config, state, _ = read_hf(moe_folders["qwen3moe"])
    reference = build_model(config, dict(state), torch.float32, weights="f32")
    model = build_model(config, dict(state), torch.float32, weights=weights)
    kinds = {m.experts.kinds for m in model.modules() if hasattr(m, "experts")}
    assert kinds and all((k[0] == -1) == (weights == "f16") for k in kinds)
    ids = list(range(5, 40))
    outs = []
    for m in (model, reference):
        with Session(config) as session, torch.no_grad():
            outs.append(run_prompt(session.committing(m), config, ids, [20, 15], all_logits=True))
    tolerance = {"q8_0": 0.05, "q4_0": 0.5, "f16": 0.01}[weights]
    assert (outs[0] - outs[1]).abs().max() < tolerance


def test_moe_metadata_is_read_and_checked():
    meta = {"general.architecture": "qwen3moe", "qwen3moe.block_count": 2, "qwen3moe.embedding_length": 64,
            "qwen3moe.attention.head_count": 4, "qwen3moe.feed_forward_length": 128, "qwen3moe.vocab_size": 100,
            "qwen3moe.expert_count": 8, "qwen3moe.expert_used_count": 2, "qwen3moe.expert_feed_forward_length": 32}
    config = from_gguf_metadata(meta, True)
    assert (config.n_experts, config.n_experts_used, config.expert_ffn_dim, config.routing) == (8, 2, 32, "softmax_norm")
    from models.config import UnsupportedModel

    with pytest.raises(UnsupportedModel, match="expert_used_count"):
        from_gguf_metadata({k: v for k, v in meta.items() if k != "qwen3moe.expert_used_count"}, True)
    with pytest.raises(UnsupportedModel, match="experts used"):
        from_gguf_metadata({**meta, "qwen3moe.expert_used_count": 9}, True)


@needs_kernels
@pytest.mark.slow
def test_the_compiled_package_of_a_moe_program_computes_the_same_bits(moe_folders, tmp_path):
    """AOTInductor's package calls the expert op (a Python op) through its proxy executor, as the program does."""
    from models.compiled_program import PACKAGE_FILE, compile_package

    eager = build_and_save(moe_folders["gpt-oss"], tmp_path / "artifact")
    compile_package(eager.forward.module, eager.config.max_context, eager.folder)
    compiled = load_model(str(eager.folder))
    assert compiled.forward.compiled and (eager.folder / PACKAGE_FILE).is_file()
    ids = eager.tokenizer.encode(PROMPT)
    outs = []
    for model in (eager, compiled):
        with Session(model.config) as session, torch.no_grad():
            outs.append(run_prompt(session.committing(model.forward), model.config, ids, [5, len(ids) - 5], all_logits=True))
    assert torch.equal(*outs)
    assert greedy(eager.forward, eager.config, ids, 12) == greedy(compiled.forward, compiled.config, ids, 12)


def build_and_save(folder, out):
    """The folder exported as stored into an artifact at `out`, loaded back as program.py."""
    from models.artifact_save import save_artifact
    from models.export import export_program

    config, state, tokenizer = read_hf(folder)
    model = build_model(config, state, torch.float32, weights="q8_0")
    save_artifact(out, export_program(model), config, tokenizer, torch.float32, name="gpt-oss", weights="q8_0")
    return load_model(str(out), compiled=False)
