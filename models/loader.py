"""Turn a model name, .gguf path, HF folder or artifact folder into a ready exported program."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from . import export as export_mod
from .compiled_program import Program
from .catalog import NAMED_MODELS, cache_dir, fetch
from .errors import ModelLoadError
from .artifact_save import save_artifact
from .export import LoadedModel, activations_for, build_model, export_program, is_artifact, load_artifact
from .gguf_loader import read_gguf
from .hf_loader import read_hf
from .quant import ACTIVATIONS, REQUANTIZE, model_kernels_available

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
STALE_AFTER_S = 3600


def resolve_weights(weights: str) -> str:
    """"auto" -> the weights as stored, which needs the kernels (AVX2 and a C++ compiler); else f16."""
    if weights != "auto":
        return weights
    if model_kernels_available():
        return "stored"
    print("the block-format kernels are unavailable here: requantizing the weights to f16", file=sys.stderr)
    return "f16"


def resolve(spec: str) -> Path:
    """A named model (fetched on first use) or a local path."""
    if spec in NAMED_MODELS:
        return fetch(spec)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"{spec!r} is neither a named model ({', '.join(NAMED_MODELS)}) nor an existing path")
    return path


def read_checkpoint(path: Path, dtype: torch.dtype, progress: bool = False):
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path}: expected a .gguf file, a Hugging Face folder or an artifact folder")
        return read_gguf(path, dtype, progress)
    return read_hf(path, dtype, progress)


def export_checkpoint(path: Path, dtype: torch.dtype, progress: bool = False, weights: str = "f32",
                      activations: str = ACTIVATIONS[0]):
    """-> (exported program, config, tokenizer, (held types, held bytes)) for a .gguf file or HF folder."""
    config, state, tokenizer = read_checkpoint(path, dtype, progress)
    if weights in REQUANTIZE or (weights in ("f16", "f32") and path.is_file()):
        print(f"{path.name}: converting every weight to {weights}, as --weights asks (auto serves them as stored)", file=sys.stderr)
    with tqdm(total=2, desc="exporting", disable=not progress, unit="stage") as bar:
        model = build_model(config, state, dtype, weights, activations)
        bar.update()
        program = export_program(model)
        bar.update()
    return program, config, tokenizer, (model.held, model.held_bytes)


def _source_key(path: Path, dtype: torch.dtype, weights: str, activations: str) -> str:
    """Changes whenever the checkpoint, the dtype, the weight mode, the activations or the model code changes."""
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")) if path.is_dir() else [path]:
        if p.is_file():
            st = p.stat()
            h.update(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    h.update(f"{dtype}|{weights}|{activations}".encode())
    code = Path(__file__).parent
    for source in sorted(code.glob("*.py")) + sorted(code.glob("kernels/*.cpp")) + sorted(code.glob("kernels/*.h")):
        h.update(source.read_bytes())
    h.update(str(export_mod.ARTIFACT_FORMAT).encode())
    return h.hexdigest()[:24]


def _prune_stale(fresh: Path) -> None:
    """Removes the cache's other artifacts of fresh's checkpoint, dtype, weight mode and activations, unused
    for STALE_AFTER_S: made by an earlier kvserve or from the file before it changed, never to load again,
    and each as large as the model. A recent one may be another kvserve version's, running beside this."""
    meta = _artifact_meta(fresh)
    same = ("source", "dtype", "weights", "activations")
    for folder in fresh.parent.iterdir():
        other = _artifact_meta(folder) if folder != fresh and folder.is_dir() else None
        if other and all(other.get(k) == meta.get(k) for k in same) and time.time() - folder.stat().st_mtime > STALE_AFTER_S:
            shutil.rmtree(folder, ignore_errors=True)


def _artifact_meta(folder: Path) -> dict | None:
    try:
        meta = json.loads((folder / "kvserve.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("source") else None


def load_model(spec: str, dtype: str = "float32", progress: bool = False, use_cache: bool = True, weights: str = "f32",
               trust_artifact: bool = False, compiled: bool = True, activations: str = ACTIVATIONS[0],
               write_behind: bool = False) -> LoadedModel:
    """Load an artifact as is (its program only if kvserve exported it, or `trust_artifact`); export a
    checkpoint once and keep the artifact in the cache folder. With `compiled`, an artifact's compiled
    package runs where it has one (models/compiled_program.py). With `write_behind`, a fresh export's
    artifact is written while the model serves from memory (LoadedModel.saving)."""
    weights = resolve_weights(weights)
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    path = resolve(spec)
    if path.is_dir() and is_artifact(path):
        return load_artifact(path, trusted=trust_artifact, compiled=compiled)
    torch_dtype = DTYPES[dtype]
    activations = activations_for(weights, activations)
    cached = cache_dir() / "artifacts" / _source_key(path, torch_dtype, weights, activations)
    if use_cache and is_artifact(cached):
        try:  # named as asked now: the cached export may have been made under another name for the same file
            loaded = dataclasses.replace(load_artifact(cached, compiled=compiled), name=spec)
            with contextlib.suppress(OSError):  # a read-only cache still loads
                os.utime(cached)  # its last use, which keeps it from _prune_stale
            return loaded
        except ModelLoadError as e:  # damaged or changed since kvserve wrote it: export it again over it
            print(f"re-exporting {spec}: {e}", file=sys.stderr)
    start = time.time()
    program, config, tokenizer, held = export_checkpoint(path, torch_dtype, progress, weights, activations)
    saving = None
    if use_cache:
        saving = save_artifact(cached, program, config, tokenizer, torch_dtype, name=spec, weights=weights, held=held[0],
                               held_bytes=held[1], activations=activations, source=str(path.resolve()),
                               background=write_behind, after=lambda: _prune_stale(cached))
    if progress:
        print(f"exported {spec} in {time.time() - start:.1f}s" + (" (saving it in the background)" if write_behind else ""),
              file=sys.stderr)
    forward = Program(export_mod.runnable_module(program))
    return LoadedModel(config=config, forward=forward, tokenizer=tokenizer, name=spec, dtype=torch_dtype, weights=weights,
                       activations=activations, fingerprint=saving.fingerprint if saving else "", held=held[0],
                       held_bytes=held[1], folder=cached if use_cache else None, saving=saving if write_behind else None)
