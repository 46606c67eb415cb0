"""Saving an exported program as an artifact folder: program.py, weights.safetensors, config.json, the
tokenizer's files and kvserve.json (the hashes trust.py checks), written into a temporary sibling and
renamed, so that a crash never leaves a half-written artifact.

Why the weights file is written here and not by safetensors' `save_file`: the hashes come from the
weights in memory, before a byte is written. A first start of a new checkpoint (`background`) then knows
its fingerprint (what the disk tier's KV is keyed on) at once, serves, and writes the 12-19 GB behind:
neither the write nor a read-back to hash it stands between the start and healthy. The bytes are
safetensors' format: the header's length in 8 bytes, the JSON header padded with spaces to a multiple of
8, then the tensors back to back, widest element first, so each starts aligned to its element.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.utils._pytree as pytree

from . import trust
from .catalog import sha256_of
from .config import ModelConfig
from .export import ARTIFACT_FORMAT, PROGRAM_FILE, PROGRAM_GLOBALS, WEIGHTS_FILE, fingerprint, runnable_module
from .quant import ACTIVATIONS
from .tokenizer import TextTokenizer
from .weight_memory import SAFETENSORS_DTYPES

log = logging.getLogger("kvserve")

SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
CHUNK = 64 << 20  # bytes a write (and a check for stop) at a time


class WeightsFile:
    """A dict of contiguous tensors laid out as one safetensors file, hashed and written from memory."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = sorted(tensors.items(), key=lambda kv: (-kv[1].dtype.itemsize, kv[0]))
        header, at = {}, 0
        for name, t in self.tensors:
            assert t.is_contiguous(), f"{name} is not contiguous"
            header[name] = {"dtype": SAFETENSORS_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + t.nbytes]}
            at += t.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.header = len(text).to_bytes(8, "little") + text

    def chunks(self) -> Iterator[memoryview]:
        yield memoryview(self.header)
        for _, t in self.tensors:
            flat = t.detach().reshape(-1).view(torch.uint8).numpy()
            for i in range(0, len(flat), CHUNK):
                yield memoryview(flat[i : i + CHUNK])

    def sha256(self) -> str:
        h = hashlib.sha256()
        for chunk in self.chunks():
            h.update(chunk)
        return h.hexdigest()


class ArtifactSave:
    """One artifact being saved: its hashes and fingerprint known from the start, its folder in place once
    `wait()` says True. `stop()` abandons it, removing what was written."""

    def __init__(self, folder: Path, tmp: Path, weights: WeightsFile, meta: dict, after: Callable[[], None] | None) -> None:
        self.folder, self.tmp, self.weights, self.meta, self.after = folder, tmp, weights, meta, after
        self.hashes = meta["sha256"]
        self.fingerprint = fingerprint(tmp, self.hashes)  # the folder's small files are written already
        self._stop, self._done, self._ok = threading.Event(), threading.Event(), False

    def run(self, background: bool) -> None:
        if not background:
            self._write()
            return
        def write_logged() -> None:
            try:
                self._write()
            except Exception as e:  # the model serves from memory all the same; the next start exports again
                log.warning("could not save the artifact %s (%s): the next start exports the model again", self.folder, e)
        threading.Thread(target=write_logged, name="kvserve-save-artifact", daemon=True).start()

    def _write(self) -> None:
        start = time.time()
        try:
            with open(self.tmp / WEIGHTS_FILE, "wb", buffering=0) as f:
                for chunk in self.weights.chunks():
                    if self._stop.is_set():
                        return
                    while chunk:  # a write may take fewer bytes than asked
                        chunk = chunk[os.write(f.fileno(), chunk):]
                os.fsync(f.fileno())  # kvserve.json vouches for these bytes: they are on the disk before it is
            for f, sha in self.hashes.items():
                trust.remember(self.tmp / f, sha)  # the folder's rename keeps each file's stat
            (self.tmp / "kvserve.json").write_text(json.dumps(self.meta, indent=2))
            if self.folder.exists():
                shutil.rmtree(self.folder)
            self.tmp.rename(self.folder)
            trust.trust(self.hashes[PROGRAM_FILE])
            self._ok = True
            log.info("saved the artifact %s in %.1fs", self.folder, time.time() - start)
            if self.after is not None:
                self.after()
        finally:
            if not self._ok:
                shutil.rmtree(self.tmp, ignore_errors=True)
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the artifact is in its folder (False: not yet within timeout, stopped, or failed)."""
        self._done.wait(timeout)
        return self._ok

    def stop(self) -> None:
        """Abandon a write still under way (the process is ending), and wait until its files are gone."""
        self._stop.set()
        self._done.wait()


def save_artifact(folder: Path, program, config: ModelConfig, tokenizer: TextTokenizer, dtype: torch.dtype, name: str,
                  weights: str = "f32", held: tuple[tuple[str, int], ...] = (), held_bytes: int = 0,
                  activations: str = ACTIVATIONS[0], source: str = "", background: bool = False,
                  after: Callable[[], None] | None = None) -> ArtifactSave:
    """The artifact into `folder`; `source`, the checkpoint's resolved path where it came from one. With
    `background`, the weights file is written by a thread of its own; `after` runs once the folder is in place."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(folder.parent)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.{os.getpid()}."))
    try:
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
        weights_file = WeightsFile(tensors)
        (tmp / "config.json").write_text(config.to_json())
        tokenizer.save(tmp)
        # the source flattens its inputs and builds its output through these two pytree specs
        specs = {"in_spec": pytree.treespec_dumps(module._in_spec), "out_spec": pytree.treespec_dumps(module._out_spec)}
        hashes = {PROGRAM_FILE: sha256_of(tmp / PROGRAM_FILE), WEIGHTS_FILE: weights_file.sha256()}
        meta = {"format": ARTIFACT_FORMAT, "dtype": str(dtype).removeprefix("torch."), "name": name, "weights": weights,
                "activations": activations, "source": source,
                "aliases": aliases, "sha256": hashes, "held": [list(h) for h in held], "held_bytes": held_bytes, **specs}
        save = ArtifactSave(folder, tmp, weights_file, meta, after)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    save.run(background)
    return save


def _remove_abandoned(parent: Path) -> None:
    """Temporary folders whose writer died before its rename (killed, or the machine went down): each
    names its process, and one whose process is gone is never finished."""
    for tmp in parent.glob(".*.*.*"):
        pid = tmp.name.rsplit(".", 2)[-2]
        if tmp.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
