"""Every ISA path of the kernels: this CPU's (AVX512-VNNI where it has it) and AVX2 alone, run under qemu's
user-mode emulation of a Haswell CPU (no AVX-512). The block kernels promise bitwise the same outputs on
either path, and a whole model, attention included, the same logits to float rounding."""
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from models import load_model
from models.formats import FORMATS
from models.formats.panels import INT8_ACTIVATIONS
from models.quant import model_kernels_available
from tests.models.gguf_files import random_blocks, write_llama_gguf
from tests.models.test_formats import stored_panels
from tests.models.test_models import PROMPT, Session, run_prompt

QEMU = shutil.which("qemu-x86_64")
ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.skipif(not model_kernels_available(), reason="no AVX2 CPU or compiler here"),
              pytest.mark.skipif(QEMU is None, reason="qemu-user is not installed (make test installs it)")]

ON_AVX2 = """
import sys, torch
from models.quant import model_kernels_available
assert torch.backends.cpu.get_cpu_capability() == "AVX2", torch.backends.cpu.get_cpu_capability()
assert model_kernels_available()
"""

PRODUCTS = ON_AVX2 + """
inputs = torch.load(sys.argv[1])
torch.save({name: (torch.ops.kvserve_native.linear_blocks(x, [p], [n], [kind]),
                   torch.ops.kvserve_native.rows_blocks(p, torch.arange(n), kind))
            for name, (x, p, n, kind) in inputs.items()}, sys.argv[2])
"""

LOGITS = ON_AVX2 + """
from models import load_model
from tests.models.test_models import PROMPT, Session, run_prompt
model = load_model(sys.argv[1], weights="stored")
with Session(model.config) as session, torch.no_grad():
    torch.save(run_prompt(session.committing(model.forward), model.config, model.tokenizer.encode(PROMPT)), sys.argv[2])
"""


def on_haswell(script: str, *args: str) -> None:
    done = subprocess.run([QEMU, "-cpu", "Haswell", sys.executable, "-c", script, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_avx2_path_gives_the_same_bits_as_this_cpus(tmp_path):
    """Each format at 1 row (the one-row tile on AVX2; on AVX-512 a wide tile of four sums), 3 (a full tile
    on AVX2; on AVX-512 one unpacking in registers), 8 and 17 (wide tiles on VNNI, unpacked panels on
    AVX2), with int16 and int8 activations, and its rows as an embedding reads them."""
    rng = np.random.default_rng(5)
    inputs = {}
    for gguf_type in sorted(FORMATS):
        rows, k = 40, 512
        panels = stored_panels(gguf_type, random_blocks(gguf_type, rows, k, rng))
        for m in (1, 3, 8, 17):
            for flag, acts in ((0, "int16"), (INT8_ACTIVATIONS, "int8")):
                inputs[f"{gguf_type} x{m} {acts}"] = (torch.randn(m, k), panels, rows, FORMATS[gguf_type].kind.id | flag)
    torch.save(inputs, tmp_path / "in.pt")
    on_haswell(PRODUCTS, str(tmp_path / "in.pt"), str(tmp_path / "out.pt"))
    emulated = torch.load(tmp_path / "out.pt")
    for name, (x, panels, rows, kind) in inputs.items():
        assert torch.equal(emulated[name][0], torch.ops.kvserve_native.linear_blocks(x, [panels], [rows], [kind])), name
        assert torch.equal(emulated[name][1], torch.ops.kvserve_native.rows_blocks(panels, torch.arange(rows), kind)), name


def test_a_model_runs_alike_on_either_path(tmp_path, smollm_path):
    """A Q4_K_M-like mix: the attention kernels and every fused op on AVX2 alone, against this CPU's."""
    path = write_llama_gguf(tmp_path / "mix.gguf", smollm_path, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn=512,
                            types={"attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q8_0", "*": "Q4_K"})
    model = load_model(str(path), weights="stored")  # exports, and keeps the artifact the emulated run loads
    with Session(model.config) as session, torch.no_grad():
        native = run_prompt(session.committing(model.forward), model.config, model.tokenizer.encode(PROMPT))
    on_haswell(LOGITS, str(path), str(tmp_path / "logits.pt"))
    emulated = torch.load(tmp_path / "logits.pt")
    # norms, attention and torch's own ops sum in another order on 256-bit vectors: rounding, not a fault,
    # which would be off by the logits' own size
    assert float((emulated - native).norm() / native.norm()) < 1e-3
    assert torch.equal(emulated.topk(5).indices, native.topk(5).indices)
