"""An artifact's program.py is code that loading runs: kvserve runs only the programs it exported itself,
unchanged, unless the user trusts the folder."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from models import load_model, trust
from models.catalog import sha256_of
from models.errors import ModelLoadError
from models.artifact_save import save_artifact
from models.export import PROGRAM_FILE, WEIGHTS_FILE, load_artifact
from models.loader import export_checkpoint


@pytest.fixture(scope="module")
def exported(tiny_checkpoints, tmp_path_factory):
    folder = tmp_path_factory.mktemp("trust") / "tiny"
    program, config, tokenizer, _ = export_checkpoint(tiny_checkpoints["llama"], torch.float32)
    save_artifact(folder, program, config, tokenizer, torch.float32, name="tiny")
    return folder


def tampered(exported, tmp_path, marker):
    """A copy whose program also writes `marker` when it is run."""
    copy = tmp_path / "copy"
    shutil.copytree(exported, copy)
    with open(copy / PROGRAM_FILE, "a") as f:
        f.write(f"\nopen({str(marker)!r}, 'w').write('ran')\n")
    return copy


def test_an_artifact_kvserve_exported_loads_and_records_its_hashes(exported):
    meta = json.loads((exported / "kvserve.json").read_text())
    assert set(meta["sha256"]) == {PROGRAM_FILE, WEIGHTS_FILE} and all(len(h) == 64 for h in meta["sha256"].values())
    assert load_artifact(exported).config.n_layers == 3


def test_a_tampered_program_is_refused_and_never_runs(exported, tmp_path):
    marker = tmp_path / "ran"
    copy = tampered(exported, tmp_path, marker)
    with pytest.raises(ModelLoadError, match="changed after export.*--trust-artifact"):
        load_model(str(copy))
    meta = json.loads((copy / "kvserve.json").read_text())  # the hash made to match: still not ours
    meta["sha256"][PROGRAM_FILE] = sha256_of(copy / PROGRAM_FILE)
    (copy / "kvserve.json").write_text(json.dumps(meta))
    with pytest.raises(ModelLoadError, match="not exported by kvserve.*--trust-artifact"):
        load_model(str(copy))
    run = subprocess.run([sys.executable, "-m", "server.cli", "generate", "--model", str(copy), "Hello"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "--trust-artifact" in run.stderr, run.stderr[-2000:]
    assert not marker.exists()
    load_model(str(copy), trust_artifact=True)  # the user's own decision: then it runs
    assert marker.read_text() == "ran"


def test_changed_weights_are_refused(exported, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(exported, copy)
    data = bytearray((copy / WEIGHTS_FILE).read_bytes())
    data[-1] ^= 0xFF
    (copy / WEIGHTS_FILE).write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=f"{WEIGHTS_FILE} does not have the hash"):
        load_model(str(copy))


def test_weights_changed_in_place_with_their_mtime_restored_are_refused(exported, tmp_path):
    """A load knows a file it hashed before by its stat; a write moves the ctime, which nothing sets back."""
    copy = tmp_path / "copy"
    shutil.copytree(exported, copy)
    meta = json.loads((copy / "kvserve.json").read_text())
    weights = copy / WEIGHTS_FILE
    assert trust.has_hash(weights, meta["sha256"][WEIGHTS_FILE])  # hashed, and its stat recorded
    before = weights.stat()
    with open(weights, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert weights.stat().st_size == before.st_size and weights.stat().st_mtime_ns == before.st_mtime_ns
    with pytest.raises(ModelLoadError, match=f"{WEIGHTS_FILE} does not have the hash"):
        load_artifact(copy)


def test_a_loaded_artifact_maps_its_weights_from_the_file(exported):
    """The weights are views of the file's mapping, not a copy: the program's tensors hold the file's bytes."""
    loaded = load_artifact(exported)
    tensors = dict(loaded.forward.module.named_buffers())
    big = max(tensors.values(), key=lambda t: t.numel())
    saved = safetensors.torch.load_file(str(exported / WEIGHTS_FILE))
    name = next(n for n, t in tensors.items() if t is big)
    assert torch.equal(saved[name], big)
    maps = Path(f"/proc/{os.getpid()}/maps").read_text()
    assert str((exported / WEIGHTS_FILE).resolve()) in maps
