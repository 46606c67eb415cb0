"""Building the native kernels: a build killed midway leaves torch's lock marker behind, and the next
build must not wait on it forever."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcache.native import cpu_has_avx2

ROOT = Path(__file__).resolve().parents[2]
SOURCE = """
#include <ATen/ATen.h>
#include <torch/library.h>
at::Tensor twice(const at::Tensor& x) { return x.mul(2); }
TORCH_LIBRARY(kvserve_build_test, m) { m.def("twice(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(kvserve_build_test, CPU, m) { m.impl("twice", &twice); }
"""
BUILD = """
import sys, torch
from pathlib import Path
from kvcache.native import build_folder, load_native
source = Path(sys.argv[1])
folder = build_folder("build_test", [source])
folder.mkdir(parents=True)
(folder / "lock").touch()  # what torch leaves when a build of this folder was killed
load_native("build_test", [source])
print(torch.ops.kvserve_build_test.twice(torch.ones(2)).tolist())
"""


@pytest.mark.skipif(not cpu_has_avx2(), reason="the kernels build only for AVX2 CPUs")
def test_a_build_killed_midway_does_not_hang_the_next(tmp_path):
    source = tmp_path / "src" / "twice.cpp"
    source.parent.mkdir()
    source.write_text(SOURCE)
    env = dict(os.environ, KVSERVE_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", BUILD, str(source)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[2.0, 2.0]"
