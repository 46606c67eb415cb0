"""Build the decoder from loaded weights, export it once, and save/load artifact folders."""
from __future__ import annotations

import copy
import hashlib
import json
import math
import operator
import shutil
import tempfile
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.utils._pytree as pytree
from safetensors.torch import load_file, save_file
from torch.export import Dim

from . import trust
from .catalog import sha256_of
from .config import ModelConfig
from .errors import ModelLoadError
from .fused import use_native_modules
from .llama import Transformer
from .quant import WEIGHT_MODES, convert_linears, model_kernels_available
from .tokenizer import TextTokenizer

# 9: hidden rows as a second input and output; 8: q4 decoder weights stacked by kind (7: one op a step; 6: three a
# layer; 5: panels at load)
ARTIFACT_FORMAT = 9
# The program once, as the Python source torch.fx generates for it, and its weights once, in safetensors.
# Not a torch.export .pt2: that holds a second copy of the weights, and deserializing its graph takes
# far longer than the forward it describes; fx's source is readable, and runs as it was exported.
PROGRAM_FILE = "program.py"
WEIGHTS_FILE = "weights.safetensors"
# What fx's generated source may name besides `self`: the globals of Graph.python_code.
PROGRAM_GLOBALS = {"inf": math.inf, "nan": math.nan, "NoneType": type(None), "torch": torch, "device": torch.device,
                   "fx_pytree": torch.fx._pytree, "pytree": pytree}


@dataclass(frozen=True)
class LoadedModel:
    """An exported program ready to run, with the config and tokenizer it came with."""

    config: ModelConfig
    # (tokens, positions, logits rows, hidden rows) -> (logits, final normed hidden states): Transformer.forward
    forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    tokenizer: TextTokenizer
    name: str
    dtype: torch.dtype
    weights: str = "f32"
    fingerprint: str = ""  # a hash of the artifact's program, weights, config and tokenizer: what its KV depends on


def fuse_projections(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Checkpoint names (q/k/v_proj, gate/up_proj) -> the fused qkv_proj and gate_up_proj weights."""
    state = dict(state)
    for i in range(config.n_layers):
        attn, mlp = f"layers.{i}.self_attn", f"layers.{i}.mlp"
        for kind in ("weight", "bias"):
            parts = [state.pop(f"{attn}.{p}_proj.{kind}", None) for p in "qkv"]
            if all(p is not None for p in parts):
                state[f"{attn}.qkv_proj.{kind}"] = torch.cat(parts)  # [(H_q + 2 H_kv) * D, ...]
        gate, up = state.pop(f"{mlp}.gate_proj.weight", None), state.pop(f"{mlp}.up_proj.weight", None)
        if gate is not None and up is not None:
            state[f"{mlp}.gate_up_proj.weight"] = torch.cat([gate, up])  # [2 * ffn, dim]
    return state


def build_model(config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, weights: str = "f32") -> Transformer:
    """Construct on the meta device, then assign the loaded weights (no double allocation)."""
    if weights not in WEIGHT_MODES:
        raise ModelLoadError(f"unsupported weights mode {weights!r}; choose one of {', '.join(WEIGHT_MODES)}")
    state = fuse_projections(state, config)
    with torch.device("meta"):
        model = Transformer(config)
    if config.tie_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    expected = set(model.state_dict()) - ({"lm_head.weight"} if config.tie_embeddings else set())
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or extra:
        raise ModelLoadError(f"checkpoint does not fit the {config.architecture} model: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, tensor in model.state_dict().items():
        if name in state and tuple(state[name].shape) != tuple(tensor.shape):
            raise ModelLoadError(f"weight {name} has shape {tuple(state[name].shape)}, expected {tuple(tensor.shape)}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.reset_constants()
    convert_linears(model, weights)
    # f32 stays the plain-torch reference, but for its linears; q4/q8 already required the kernels, f16 uses them if they build
    if weights != "f32" and dtype == torch.float32 and model_kernels_available():
        use_native_modules(model)
    return model.eval()


def export_program(model: Transformer) -> torch.export.ExportedProgram:
    """One program for prefill, chunks and decode: the token, logit-row and hidden-row counts are dynamic
    (no hidden rows at all in a step without embeddings)."""
    max_ctx = max(model.config.max_context, 16)
    n, m = Dim("n_tokens", min=1, max=max_ctx), Dim("n_logits", min=1, max=max_ctx)
    h = Dim("n_hidden", min=0, max=max_ctx)
    example = (torch.zeros(1, 4, dtype=torch.long), torch.arange(4).unsqueeze(1), torch.tensor([1, 3]), torch.tensor([0, 2, 3]))
    with torch.no_grad():
        return torch.export.export(model, example, dynamic_shapes=({1: n}, {0: n}, {0: m}, {0: h}), strict=False)


def runnable_module(program: torch.export.ExportedProgram) -> torch.fx.GraphModule:
    """The program's unlifted module (weights as attributes), minus export's input-guard call.

    The guard re-checks the dynamic-shape ranges on every call and holds a closure that cannot be
    pickled; the engine builds every input itself, and the kernels check what they rely on.
    """
    module = program.module()
    graph = copy.deepcopy(module.graph)
    # Weights as flat attributes of one module: `self.layers_3_mlp_down_proj_packed` costs one
    # attribute lookup a use where the nested path costs four, and a step has hundreds of uses.
    root = torch.nn.Module()
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn" and not node.users:
            graph.erase_node(node)
        elif node.op == "get_attr":
            flat = node.target.replace(".", "_")
            value = operator.attrgetter(node.target)(module)
            if isinstance(value, torch.Tensor):
                root.register_buffer(flat, value)
            else:
                setattr(root, flat, value)
            node.target = flat
        elif node.op == "call_module":
            setattr(root, node.target.replace(".", "_"), module.get_submodule(node.target))
            node.target = node.target.replace(".", "_")
    return torch.fx.GraphModule(root, graph)


def save_artifact(
    folder: Path, program, config: ModelConfig, tokenizer: TextTokenizer, dtype: torch.dtype, name: str, weights: str = "f32"
) -> None:
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Write into a temporary sibling and rename, so a crash never leaves a half-written artifact.
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    module = runnable_module(program)
    assert set(module.graph.python_code("self").globals) <= set(PROGRAM_GLOBALS), "the program names a global load cannot give it"
    (tmp / PROGRAM_FILE).write_text(module.code)
    # Each tensor once: a tied weight (the lm_head reading the embeddings) is stored once, and named again.
    tensors, aliases, seen = {}, {}, {}
    for attr, tensor in module.state_dict(keep_vars=True).items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype)
        if key in seen:
            aliases[attr] = seen[key]
        else:
            seen[key], tensors[attr] = attr, tensor.detach().contiguous()
    save_file(tensors, str(tmp / WEIGHTS_FILE))
    (tmp / "config.json").write_text(config.to_json())
    tokenizer.save(tmp)
    # the source flattens its inputs and builds its output through these two pytree specs
    specs = {"in_spec": pytree.treespec_dumps(module._in_spec), "out_spec": pytree.treespec_dumps(module._out_spec)}
    hashes = {f: sha256_of(tmp / f) for f in (PROGRAM_FILE, WEIGHTS_FILE)}
    meta = {"format": ARTIFACT_FORMAT, "dtype": str(dtype).removeprefix("torch."), "name": name, "weights": weights,
            "aliases": aliases, "sha256": hashes, **specs}
    (tmp / "kvserve.json").write_text(json.dumps(meta, indent=2))
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)
    trust.trust(hashes[PROGRAM_FILE])


def _program(folder: Path, meta: dict) -> torch.nn.Module:
    """The saved program: fx's source, run as the forward of a module that holds the saved weights."""
    root = torch.nn.Module()
    tensors = load_file(str(folder / WEIGHTS_FILE))
    tensors.update({a: tensors[c] for a, c in meta["aliases"].items()})
    for attr, tensor in tensors.items():
        root.register_buffer(attr, tensor)
    root._in_spec, root._out_spec = pytree.treespec_loads(meta["in_spec"]), pytree.treespec_loads(meta["out_spec"])
    namespace = dict(PROGRAM_GLOBALS)
    exec(compile((folder / PROGRAM_FILE).read_text(), str(folder / PROGRAM_FILE), "exec"), namespace)  # noqa: S102
    root.forward = types.MethodType(namespace["forward"], root)
    return root


def is_artifact(folder: Path) -> bool:
    return (Path(folder) / PROGRAM_FILE).is_file() and (Path(folder) / "kvserve.json").is_file()


def load_artifact(folder: Path, trusted: bool = False) -> LoadedModel:
    """Load an artifact folder; its program runs only if kvserve exported it here, unchanged, or if the
    caller trusts the folder (`trusted`, the CLI's --trust-artifact)."""
    folder = Path(folder)
    meta = json.loads((folder / "kvserve.json").read_text())
    if meta.get("format") != ARTIFACT_FORMAT:
        raise ModelLoadError(f"{folder}: artifact format {meta.get('format')} is not {ARTIFACT_FORMAT}; export again")
    if not trusted:
        trust.check(folder, meta.get("sha256", {}), (PROGRAM_FILE, WEIGHTS_FILE))
    # The program may call kvserve_native ops (q4 always does), which must exist before it is read.
    kernels = model_kernels_available()
    if meta.get("weights") == "q4" and not kernels:
        raise ModelLoadError(f"{folder}: a {meta['weights']} artifact needs the C++/AVX2 kernels, which are unavailable here")
    forward = _program(folder, meta)
    config = ModelConfig.from_json((folder / "config.json").read_text())

    # a trusted folder's recorded hashes went unchecked, so its fingerprint hashes the files themselves
    hashes = {f: sha256_of(folder / f) for f in (PROGRAM_FILE, WEIGHTS_FILE)} if trusted else meta["sha256"]
    return LoadedModel(
        config=config,
        forward=forward,
        tokenizer=TextTokenizer.load(folder),
        name=meta["name"],
        dtype=getattr(torch, meta["dtype"]),
        weights=meta.get("weights", "f32"),
        fingerprint=fingerprint(folder, hashes),
    )


def fingerprint(folder: Path, hashes: dict | None = None) -> str:
    """What an artifact's KV depends on, as one hash: its program and weights (by their SHA-256, as
    kvserve.json records them unless `hashes` are given), its config, and its tokenizer's files (the
    chat template included)."""
    hashes = hashes if hashes is not None else json.loads((Path(folder) / "kvserve.json").read_text())["sha256"]
    h = hashlib.sha256(json.dumps(hashes, sort_keys=True).encode())
    for f in sorted(Path(folder).iterdir()):
        if f.is_file() and f.name not in (PROGRAM_FILE, WEIGHTS_FILE, "kvserve.json"):
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()
