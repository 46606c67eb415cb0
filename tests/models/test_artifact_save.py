"""A fresh export serves from memory while its artifact is written behind it: the artifact that lands is
the one the next start loads, with the fingerprint the first start already served under."""
import os
import shutil

import safetensors

from models import load_model
from models.catalog import cache_dir, sha256_of
from models.export import WEIGHTS_FILE


def test_a_fresh_export_serves_at_once_and_its_artifact_lands_whole(tiny_checkpoints, tmp_path):
    source = tmp_path / "llama"
    shutil.copytree(tiny_checkpoints["llama"], source)  # a path of its own: no artifact of it yet
    abandoned = cache_dir() / "artifacts" / ".0123abcd.999999999.x"  # a writer that died (no such pid)
    ours = cache_dir() / "artifacts" / f".0123abcd.{os.getpid()}.y"  # one still being written
    for folder in (abandoned, ours):
        folder.mkdir(parents=True)

    first = load_model(str(source), write_behind=True)
    assert first.saving is not None and first.saving.wait(timeout=300)
    assert not abandoned.exists() and ours.is_dir()
    ours.rmdir()

    second = load_model(str(source))
    assert second.saving is None and second.folder == first.folder
    assert second.fingerprint == first.fingerprint  # the disk tier's KV of the first start is the second's
    weights = second.folder / WEIGHTS_FILE
    assert sha256_of(weights) == first.saving.hashes[WEIGHTS_FILE]  # the hash taken in memory is the file's
    with safetensors.safe_open(str(weights), "pt") as f:  # safetensors' own reader takes the file
        assert len(list(f.keys())) > 0
    assert not list(second.folder.parent.glob(f".{second.folder.name}.*"))  # no temporary folder left


def test_a_stopped_save_leaves_nothing(tiny_checkpoints, tmp_path):
    source = tmp_path / "qwen2"
    shutil.copytree(tiny_checkpoints["qwen2"], source)
    model = load_model(str(source), write_behind=True)
    model.saving.stop()
    leftovers = list(model.folder.parent.glob(f".{model.folder.name}.*"))
    assert not leftovers
    assert model.saving.wait() == model.folder.is_dir()  # stopped before the rename, or landed whole
