"""llama.cpp's llama-server for side-by-side runs: built once from the llama-cpp-python sdist's vendored
llama.cpp (the same GGUF kernels kvserve is compared with), cached under the kvserve cache folder, and
run on a free local port.

    python bench/llama_server.py        # build it if it is not cached yet; print its path

The build takes about ten minutes on 2 cores; later calls find the binary in
$KVSERVE_CACHE/llama-server/<version>/build/bin/.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from launch import running, warm_up  # noqa: E402

from tests.models.gguf_files import LLAMA_CPP_PYTHON, llama_cpp_source  # noqa: E402

from models.catalog import cache_dir  # noqa: E402
from server.local import free_port  # noqa: E402

VERSION = LLAMA_CPP_PYTHON  # llama-cpp-python, whose sdist vendors the llama.cpp revision compared
TOOLS = ("llama-server", "llama-quantize", "llama-perplexity")
SLOT_TOKENS = 3072  # a slot's context: a 2,000-token history and its reply


def serve_flags(slots: int, slot_tokens: int = SLOT_TOKENS) -> list[str]:
    return ["-np", str(slots), "-c", str(slots * slot_tokens), "--cont-batching", "--jinja"]


def binary_path() -> Path:
    return cache_dir() / "llama-server" / VERSION / "build" / "bin" / "llama-server"


def build(quiet: bool = False) -> Path:
    """The cached llama-server (and TOOLS), built first if it is not there (pip download, cmake). It is
    built where it stays: the binary finds the ggml libraries beside it in the build tree."""
    target = binary_path()
    if all((target.parent / t).is_file() for t in TOOLS):
        return target
    out = subprocess.DEVNULL if quiet else sys.stderr
    root = target.parents[2]
    source = llama_cpp_source()  # downloaded and unpacked into root/llama.cpp once
    build_dir = root / "build"
    # -march=native, but no AMX: on the virtual machines here ggml's AMX path dies at the first batch with
    # SIGILL or SIGSEGV, whether or not the kernel grants the process its tiles (a tilezero in
    # ggml_backend_amx_mul_mat, with them granted)
    no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"],
                   check=True, stdout=out, stderr=out)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", *TOOLS, "-j", str(os.cpu_count() or 2)],
                   check=True, stdout=out, stderr=out)
    return target


def tool(name: str) -> Path:
    """Another of the built tools (llama-quantize, llama-perplexity), beside llama-server."""
    return build(quiet=True).parent / name


def llama_server(binary: str | Path, gguf: str | Path, extra: list[str] | None = None, threads: int = 2, slots: int = 32,
                 slot_tokens: int = SLOT_TOKENS):
    """llama-server on the GGUF with `slots` parallel slots (-np) and `extra`: a context that gives its URL."""
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "--port", str(port), "-t", str(threads), *serve_flags(slots, slot_tokens), *(extra or [])]
    return running(cmd, port, 300, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@contextlib.contextmanager
def slots_matched(binary: str | Path, gguf: str | Path, threads: int = 2, slot_tokens: int = SLOT_TOKENS):
    """llama-server at its best flags for each load: `-np` as many as the load's concurrent requests. Gives
    url(slots), which restarts it with that many slots (and sends it a first, unmeasured request) when the
    last load had another count."""
    held: dict = {}
    with contextlib.ExitStack() as stack:
        def url(slots: int) -> str:
            if held.get("slots") != slots:
                stack.close()
                server = llama_server(binary, gguf, threads=threads, slots=slots, slot_tokens=slot_tokens)
                held.update(slots=slots, url=stack.enter_context(server))
                warm_up(held["url"])
            return held["url"]
        yield url


if __name__ == "__main__":
    print(build())
