"""Build (once, cached by source hash) and load the project's C++/AVX2 kernels."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from pathlib import Path

import torch

AVX2_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c")
# at::parallel_for is a header template: without OpenMP at compile time it runs every range on the
# calling thread. Linking -fopenmp binds libgomp.so.1, the copy torch already loaded, so the kernels
# share torch's thread pool.
OPENMP_FLAGS = ("-fopenmp",)
FLAGS = (*AVX2_FLAGS, *OPENMP_FLAGS)


class NativeUnavailable(RuntimeError):
    """The CPU lacks AVX2 or the kernels could not be compiled here."""


def cache_root() -> Path:
    """The project's cache folder ($KVSERVE_CACHE, else ~/.cache/kvserve): built kernels here, fetched
    models and exported artifacts (models.catalog) too."""
    return Path(os.environ.get("KVSERVE_CACHE") or Path.home() / ".cache" / "kvserve").expanduser()


def cpu_has_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


KERNEL_HEADERS = Path(__file__).parent / "kernels"  # simd.h, shared by every kernel


def build_folder(name: str, sources: list[Path]) -> Path:
    """Where `sources` build: the folder's name carries a hash of them, their headers, torch's version and
    the flags, so an edited kernel is rebuilt and an unchanged one is only loaded (well under a second)."""
    headers = {h for folder in {KERNEL_HEADERS, *(Path(s).parent for s in sources)} for h in Path(folder).glob("*.h")}
    inputs = [*sources, *sorted(headers)]
    digest = hashlib.sha256(b"".join(Path(s).read_bytes() for s in inputs) + f"{torch.__version__}|{list(FLAGS)}".encode()).hexdigest()[:12]
    return cache_root() / "native" / f"{name}-{digest}"


@contextlib.contextmanager
def _building(build: Path):
    """Held while one process builds into `build`: the kernel lets go of it if the process dies."""
    with open(build / "kvserve-build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def load_native(name: str, sources: list[Path]) -> None:
    """Compile `sources` into a shared library registering torch ops (once, cached in build_folder), and
    load it into this process."""
    if not cpu_has_avx2():
        raise NativeUnavailable(f"the {name} kernels need an AVX2 CPU; this one reports {torch.backends.cpu.get_cpu_capability()}")
    build = build_folder(name, sources)
    library = build / f"{name}.so"
    if str(library) in torch.ops.loaded_libraries:  # torch's own record; loading twice would register ops twice
        return
    if not library.is_file():
        from torch.utils.cpp_extension import load  # it appends to the flag lists it is given: pass fresh ones

        build.mkdir(parents=True, exist_ok=True)
        with _building(build):
            if not library.is_file():  # another process may have built it while this one waited
                # torch's own marker ("lock") outlives a build killed midway, and every later build would
                # wait on it forever; under _building no other build runs, so one found here is stale
                (build / "lock").unlink(missing_ok=True)
                try:
                    load(name, [str(s) for s in sources], extra_cflags=list(FLAGS), extra_ldflags=list(OPENMP_FLAGS),
                         extra_include_paths=[str(KERNEL_HEADERS)], build_directory=str(build), is_python_module=False)
                except Exception as e:  # a missing compiler, ninja or header surfaces as many exception types
                    raise NativeUnavailable(f"could not build the {name} kernels: {type(e).__name__}: {str(e)[-2000:]}") from None
                return
    torch.ops.load_library(str(library))
