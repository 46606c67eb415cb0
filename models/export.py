"""Build the decoder from loaded weights, export it once, and save/load artifact folders."""
from __future__ import annotations

import copy
import hashlib
import json
import math
import operator
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.export import Dim

from . import trust
from .catalog import sha256_of
from .compiled_program import PACKAGE_FILE, Program, load_package
from .architectures import build_decoder
from .config import ModelConfig
from .errors import ModelLoadError
from .expert_weights import assign_experts, take_experts
from .fused import use_native_modules
from .llama import Transformer
from .quant import (ACTIVATIONS, WEIGHT_MODES, EmbeddingBlocks, EmbeddingFloat, LinearBlocks, convert_linears, held_types,
                    model_kernels_available, quantize_activations)
from .stored import StoredTensor
from .weight_memory import read_safetensors
from .tokenizer import TextTokenizer

# 12: Q6_K panels with a byte of 6+2 bits a lane; 11: K-quant panels hold a super-block's shared fields once; 10: weights as stored, panels of each block format; 9: hidden rows as a second input and output; 8: q4 decoder weights stacked by kind (7: one op a step; 6: three a
# layer; 5: panels at load)
ARTIFACT_FORMAT = 12
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
    activations: str = ACTIVATIONS[0]  # how block-format products quantize their activations (quant.ACTIVATIONS)
    fingerprint: str = ""  # a hash of the artifact's program, weights, config and tokenizer: what its KV depends on
    held: tuple[tuple[str, int], ...] = ()  # tensors by type, as held: (("Q4_K", 97), ("F32", 33), ...)
    held_bytes: int = 0  # the weights' bytes in memory
    folder: Path | None = None  # the artifact it came from (where its compiled package goes); None: not saved
    saving: "ArtifactSave | None" = None  # a fresh export's artifact, still being written (artifact_save.py)

    def held_text(self) -> str:
        return ", ".join(f"{n} {t}" for t, n in self.held) or self.weights

    def quantization(self) -> str:
        """The type most matrices are held in (what Ollama calls the quantization level)."""
        return next((t for t, _ in self.held if t != "F32"), "F32" if self.held else self.weights.upper())


Weight = torch.Tensor | StoredTensor | tuple[StoredTensor, ...]


def fuse_projections(state: dict[str, Weight], config: ModelConfig) -> dict[str, Weight]:
    """Checkpoint names (q/k/v_proj, gate/up_proj) -> the fused qkv_proj and gate_up_proj weights: float
    tensors concatenated, a file's tensors kept as the tuple of their parts."""
    state = dict(state)

    def fused(parts):
        if all(isinstance(p, torch.Tensor) for p in parts):
            return torch.cat(parts)  # [rows of all parts, ...]
        return tuple(q for p in parts for q in (p if isinstance(p, tuple) else (p,)))

    for i in range(config.n_layers):
        attn, mlp = f"layers.{i}.self_attn", f"layers.{i}.mlp"
        for kind in ("weight", "bias"):
            parts = [state.pop(f"{attn}.{p}_proj.{kind}", None) for p in "qkv"]
            if all(p is not None for p in parts):
                state[f"{attn}.qkv_proj.{kind}"] = fused(parts)  # [(H_q + 2 H_kv) * D, ...]
        gate, up = state.pop(f"{mlp}.gate_proj.weight", None), state.pop(f"{mlp}.up_proj.weight", None)
        if gate is not None and up is not None:
            state[f"{mlp}.gate_up_proj.weight"] = fused([gate, up])  # [2 * ffn, dim]
    return state


def _shape(w: Weight) -> tuple[int, ...]:
    if isinstance(w, tuple):
        return (sum(p.shape[0] for p in w), *w[0].shape[1:])
    return tuple(w.shape)


def _as_tensor(w: Weight, keep_dtype: bool) -> torch.Tensor:
    """A file's tensors as one float tensor: stored float dtype if `keep_dtype` and they share one, else float32."""
    parts = w if isinstance(w, tuple) else (w,)
    if not all(isinstance(p, StoredTensor) for p in parts):
        return w
    if keep_dtype and all(p.is_float for p in parts) and len({p.type for p in parts}) == 1:
        return torch.cat([p.floats() for p in parts])
    return torch.cat([p.dequantize() for p in parts])


def _is_blocks(w: Weight) -> bool:
    parts = w if isinstance(w, tuple) else (w,)
    return all(isinstance(p, StoredTensor) and not p.is_float for p in parts)


def activations_for(weights: str, activations: str) -> str:
    """`activations` as a weight mode's products take it: f32 and f16 weights multiply in float ("float"),
    whatever was asked, so that no mode is refused the default (int8)."""
    if activations not in ACTIVATIONS and not (activations == "float" and weights in ("f32", "f16")):
        raise ModelLoadError(f"unsupported activations {activations!r}; choose one of {', '.join(ACTIVATIONS)}")
    return "float" if weights in ("f32", "f16") else activations


def build_model(config: ModelConfig, state: dict[str, Weight], dtype: torch.dtype, weights: str = "f32",
                activations: str = ACTIVATIONS[0]) -> Transformer:
    """Construct on the meta device, then assign the loaded weights (no double allocation). In the stored
    mode a file's block-format matrices become panels of their own format, chunk by chunk; float ones keep
    their dtype. Other modes read every weight as float32 first."""
    if weights not in WEIGHT_MODES:
        raise ModelLoadError(f"unsupported weights mode {weights!r}; choose one of {', '.join(WEIGHT_MODES)}")
    activations = activations_for(weights, activations)
    stored = weights == "stored" and dtype == torch.float32
    state, experts = take_experts(fuse_projections(state, config), config)
    with torch.device("meta"):
        model = build_decoder(config)
    if config.tie_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    expected = set(model.state_dict()) - ({"lm_head.weight"} if config.tie_embeddings else set())
    expected -= {k for k in expected if k.rsplit(".", 1)[0].endswith(".mlp.experts")}  # assign_experts checks them
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or extra:
        raise ModelLoadError(f"checkpoint does not fit the {config.architecture} model: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, tensor in model.state_dict().items():
        if name in state and _shape(state[name]) != tuple(tensor.shape):
            raise ModelLoadError(f"weight {name} has shape {_shape(state[name])}, expected {tuple(tensor.shape)}")
    blocks = {k: state.pop(k) for k in list(state) if stored and _is_blocks(state[k])}
    state = {k: _as_tensor(v, stored) for k, v in state.items()}
    state = {k: v if stored and v.dim() > 1 else v.to(dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    _assign_blocks(model, blocks, state, config.tie_embeddings)
    if config.tie_embeddings and isinstance(model.lm_head, nn.Linear):
        model.lm_head.weight = model.embed_tokens.weight
    if stored and isinstance(model.embed_tokens, nn.Embedding) and model.embed_tokens.weight.dtype != torch.float32:
        model.embed_tokens = EmbeddingFloat(model.embed_tokens.weight)
    model.reset_constants()
    assign_experts(model, experts, weights if dtype == torch.float32 or weights != "stored" else "f32", activations)
    convert_linears(model, weights if dtype == torch.float32 or weights != "stored" else "f32")
    quantize_activations(model, activations)
    model.held = held_types(model)
    model.held_bytes = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in model.state_dict().values()}.values())
    # f32 stays the plain-torch reference, but for its linears; the others use the native ops if they build
    if weights != "f32" and dtype == torch.float32 and model_kernels_available():
        use_native_modules(model)
    return model.eval()


def _assign_blocks(model: nn.Module, blocks: dict[str, Weight], state: dict[str, torch.Tensor], tied: bool) -> None:
    """The block-format matrices, as panels: each projection a LinearBlocks, the embedding table rows of one."""
    for key, w in blocks.items():
        parts = list(w) if isinstance(w, tuple) else [w]
        module = key.removesuffix(".weight")
        linear = LinearBlocks.from_stored(parts, state.get(f"{module}.bias"))
        if module == "embed_tokens":
            if tied:
                model.lm_head = linear
            model.embed_tokens = EmbeddingBlocks(linear)
        else:
            model.set_submodule(module, linear)


def export_program(model: Transformer) -> torch.export.ExportedProgram:
    return export_module(model, model.config.max_context)


def export_module(module: nn.Module, max_context: int) -> torch.export.ExportedProgram:
    """One program for prefill, chunks and decode: the token, logit-row and hidden-row counts are dynamic
    (no hidden rows at all in a step without embeddings)."""
    max_ctx = max(max_context, 16)
    n, m = Dim("n_tokens", min=1, max=max_ctx), Dim("n_logits", min=1, max=max_ctx)
    h = Dim("n_hidden", min=0, max=max_ctx)
    example = (torch.zeros(1, 4, dtype=torch.long), torch.arange(4).unsqueeze(1), torch.tensor([1, 3]), torch.tensor([0, 2, 3]))
    with torch.no_grad():
        return torch.export.export(module, example, dynamic_shapes=({1: n}, {0: n}, {0: m}, {0: h}), strict=False)


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


def saved_program(folder: Path, meta: dict, values: bool = True, small: int = 0) -> torch.nn.Module:
    """The saved program: fx's source, run as the forward of a module that holds the saved weights (or,
    without `values`, untouched buffers of their shapes but for those of at most `small` bytes)."""
    root = torch.nn.Module()
    tensors = read_safetensors(folder / WEIGHTS_FILE, values, small)
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


def load_artifact(folder: Path, trusted: bool = False, compiled: bool = True) -> LoadedModel:
    """Load an artifact folder; its program runs only if kvserve exported it here, unchanged, or if the
    caller trusts the folder (`trusted`, the CLI's --trust-artifact). With `compiled`, the program's compiled
    package runs instead where one was saved (compiled_program.py)."""
    folder = Path(folder)
    meta = json.loads((folder / "kvserve.json").read_text())
    if meta.get("format") != ARTIFACT_FORMAT:
        raise ModelLoadError(f"{folder}: artifact format {meta.get('format')} is not {ARTIFACT_FORMAT}; export again")
    if not trusted:
        trust.check(folder, meta.get("sha256", {}), (PROGRAM_FILE, WEIGHTS_FILE))
    # The program may call kvserve_native ops (q4 always does), which must exist before it is read.
    kernels = model_kernels_available()
    if meta.get("weights") not in ("f32", "f16") and not kernels:
        raise ModelLoadError(f"{folder}: a {meta['weights']} artifact needs the C++/AVX2 kernels, which are unavailable here")
    forward = Program(saved_program(folder, meta))
    package = load_package(forward.module, folder) if compiled else None
    if package is not None:
        forward.use(package)
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
        activations=meta.get("activations", "int16"),
        fingerprint=fingerprint(folder, hashes),
        held=tuple((str(t), int(n)) for t, n in meta.get("held", [])),
        held_bytes=int(meta.get("held_bytes", 0)),
        folder=folder,
    )


def fingerprint(folder: Path, hashes: dict | None = None) -> str:
    """What an artifact's KV depends on, as one hash: its program and weights (by their SHA-256, as
    kvserve.json records them unless `hashes` are given), its config, and its tokenizer's files (the
    chat template included)."""
    hashes = hashes if hashes is not None else json.loads((Path(folder) / "kvserve.json").read_text())["sha256"]
    h = hashlib.sha256(json.dumps(hashes, sort_keys=True).encode())
    for f in sorted(Path(folder).iterdir()):
        # (the compiled package computes what the program does: the KV does not depend on it)
        if f.is_file() and f.name not in (PROGRAM_FILE, WEIGHTS_FILE, "kvserve.json", PACKAGE_FILE):
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()
