"""The AVX2 kernels of the q4 weights mode against plain torch on the same numbers."""
import pytest
import torch

from models.block_quant import dequantize, quantize_q4, quantize_q8
from models.fused import NativeQKVRotary, NativeRMSNorm, NativeSwiGLU
from models.llama import QKVRotary, RMSNorm, SwiGLU
from models.quant import LinearBlocks, model_kernels_available

pytestmark = pytest.mark.skipif(not model_kernels_available(), reason="no AVX2 CPU or compiler here")


@pytest.mark.parametrize("fmt,quantize", [("q4", quantize_q4), ("q8", quantize_q8)])
def test_block_formats_requantize_losslessly(fmt, quantize):
    torch.manual_seed(0)
    packed = quantize(torch.randn(64, 256))
    values = dequantize(packed, fmt)
    assert torch.equal(quantize(values), packed)  # a GGUF's own blocks come back unchanged
    assert torch.equal(dequantize(quantize(values), fmt), values)


@pytest.mark.parametrize("fmt", ["q4", "q8"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 40])  # integer dot products below 4 rows, fbgemm fp16 from 4
def test_block_linear_matches_its_dequantized_weights(fmt, rows):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(576, 200, bias=True)
    fast = LinearBlocks(linear, fmt)
    weight = dequantize(fast.packed, fmt)
    x = torch.randn(1, rows, 576)
    with torch.no_grad():
        want = x @ weight.T + linear.bias
        got = fast(x)
    assert got.shape == (1, rows, 200)
    # int16 activations are near-exact; the fp16 GEMM rounds weights to 11 significant bits
    assert float((got - want).norm() / want.norm()) < (1e-4 if rows < 4 else 1e-3)


def test_block_linear_rejects_mismatched_weights():
    w = quantize_q4(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="bytes per row"):
        torch.ops.kvserve_native.linear_q4(torch.randn(2, 96), w)


def test_fused_modules_match_the_model_math():
    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data.normal_()
    x = torch.randn(1, 7, 576)
    torch.testing.assert_close(NativeRMSNorm(norm)(x), norm(x), atol=1e-5, rtol=1e-5)
    rotary = QKVRotary(9, 3, 64)
    qkv = torch.randn(1, 7, 15 * 64)
    angles = torch.randn(7, 32)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    for got, want in zip(NativeQKVRotary(rotary)(qkv, cos, sin), rotary(qkv, cos, sin)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    gate_up = torch.randn(1, 7, 2 * 1536) * 4
    torch.testing.assert_close(NativeSwiGLU()(gate_up), SwiGLU()(gate_up), atol=1e-5, rtol=1e-5)
