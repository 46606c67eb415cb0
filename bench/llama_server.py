"""llama.cpp's llama-server for side-by-side runs: built once from the llama-cpp-python sdist's vendored
llama.cpp (the same GGUF kernels kvserve is compared with), cached under the kvserve cache folder, and
run on a free local port.

    python bench/llama_server.py        # build it if it is not cached yet; print its path

The build takes about ten minutes on 2 cores; later calls find the binary in
$KVSERVE_CACHE/llama-server/<version>/.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from launch import running  # noqa: E402

from models.catalog import cache_dir  # noqa: E402
from server.local import free_port  # noqa: E402

VERSION = "0.3.36"  # llama-cpp-python, whose sdist vendors the llama.cpp revision compared
# 32 slots of 3,072 tokens: room for 32 conversations of 2,000-token histories and their replies
SERVE_FLAGS = ["-np", "32", "-c", "98304", "--cont-batching", "--jinja"]


def binary_path() -> Path:
    return cache_dir() / "llama-server" / VERSION / "llama-server"


def build(quiet: bool = False) -> Path:
    """The cached llama-server, built first if it is not there (pip download, cmake, one target)."""
    target = binary_path()
    if target.is_file():
        return target
    out = subprocess.DEVNULL if quiet else sys.stderr
    with tempfile.TemporaryDirectory(prefix="kvserve-llama-") as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={VERSION}", "-d", tmp], check=True, stdout=out, stderr=out)
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        source = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
        build_dir = source / "build"
        subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                        "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF"], check=True, stdout=out, stderr=out)
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(os.cpu_count() or 2)],
                       check=True, stdout=out, stderr=out)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build_dir / "bin" / "llama-server", target.with_suffix(".tmp"))
        target.with_suffix(".tmp").rename(target)
    return target


def llama_server(binary: str | Path, gguf: str | Path, extra: list[str] | None = None, threads: int = 2):
    """llama-server on the GGUF, with SERVE_FLAGS and `extra`: a context that gives its URL."""
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "--port", str(port), "-t", str(threads), *SERVE_FLAGS, *(extra or [])]
    return running(cmd, port, 300, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    print(build())
