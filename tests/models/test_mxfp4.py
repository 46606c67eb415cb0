"""MXFP4, gpt-oss's expert format, served as stored: weights gguf-py's own quantizer makes decode as ggml
does, every exponent byte included, multiply by their kernel at either activation precision whatever
shares the step, and a GGUF holding them loads as MXFP4. (test_formats.py runs its every-format checks,
and test_isa_paths.py its AVX2 path, on random MXFP4 blocks too.)"""
import numpy as np
import pytest
import torch

from models.formats import FORMATS
from models.formats.panels import INT8_ACTIVATIONS, exponent_scales
from models.quant import LinearBlocks, model_kernels_available
from models.stored import StoredTensor
from tests.models.test_formats import int8_rows, reference, stored_panels

pytestmark = pytest.mark.skipif(not model_kernels_available(), reason="no AVX2 CPU or compiler here")

MXFP4 = FORMATS["MXFP4"]


def quantized(rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """A random float weight of varied row and block scales, as gguf-py's MXFP4 quantizer writes it."""
    import gguf

    w = rng.standard_normal((rows, k)) * rng.uniform(0.001, 0.1, (rows, 1)) * rng.uniform(0.2, 5, (rows, k // 32)).repeat(32, 1)
    raw = gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType.MXFP4)
    assert raw.shape == (rows, k // 32 * 17)
    return raw


def test_every_exponent_byte_decodes_as_ggml_does():
    """e = 0..255, each with every code: 2^(e - 128), denormal below e = 2, and 2^127 at e = 255 (not a
    NaN, as ggml reads it), on dequantizing and on the kernels' row lookup alike."""
    e = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(exponent_scales(e).double(), torch.tensor([2.0 ** (i - 128) for i in range(256)], dtype=torch.float64))
    codes = np.arange(16, dtype=np.uint8)
    block = np.concatenate([[0], codes[:16] | (codes[::-1] << 4)]).astype(np.uint8)  # all 16 codes, low and high nibbles
    raw = np.tile(block, (256, 1))
    raw[:, 0] = np.arange(256)
    raw = np.tile(raw.reshape(256, 1, 17), (1, 2, 1)).reshape(256, 34)  # rows of two blocks
    with np.errstate(over="ignore"):  # 8 and 12 times 2^127
        want = reference("MXFP4", raw, 256, 64)
    assert torch.isinf(want[255]).any() and (want[0][want[0] != 0].abs().min() == 2.0 ** -128)
    assert torch.equal(MXFP4.dequantize(torch.from_numpy(raw.copy())), want)
    assert torch.equal(torch.ops.kvserve_native.rows_blocks(stored_panels("MXFP4", raw), torch.arange(256), MXFP4.kind.id), want)


def test_quantized_weights_decode_and_repack_exactly():
    rng = np.random.default_rng(11)
    rows, k = 300, 512
    raw = quantized(rows, k, rng)
    want = reference("MXFP4", raw, rows, k)
    assert torch.equal(MXFP4.dequantize(torch.from_numpy(raw.copy())), want)
    panels = stored_panels("MXFP4", raw)
    assert panels.shape == (38, k // 32, 136)  # 17 bytes a feature's block, as stored
    index = torch.tensor([0, 299, 7, 8, 150])
    assert torch.equal(torch.ops.kvserve_native.rows_blocks(panels, index, MXFP4.kind.id), want[index])


@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_quantized_weights_multiply_alike_at_every_batch(activations):
    """Against x @ W.T of the weight gguf-py decodes (int8: x rounded as that path rounds it), at 1 row and
    a batch; each row's output the same bits alone, in small tiles and among many rows."""
    rng = np.random.default_rng(12)
    rows, k = 96, 1024
    raw = quantized(rows, k, rng)
    weight = reference("MXFP4", raw, rows, k)
    kind_id = MXFP4.kind.id | (INT8_ACTIVATIONS if activations == "int8" else 0)
    panels = stored_panels("MXFP4", raw)
    x = torch.randn(40, k) * torch.linspace(0.05, 10, k)
    full = torch.ops.kvserve_native.linear_blocks(x, [panels], [rows], [kind_id])
    want = (int8_rows(x, 32) if activations == "int8" else x) @ weight.T
    assert float((full - want).norm() / want.norm()) < 1e-4
    one = torch.ops.kvserve_native.linear_blocks(x[:1], [panels], [rows], [kind_id])
    assert float((one - want[:1]).norm() / want[:1].norm()) < 1e-4
    for m in (1, 3, 16, 17):
        assert torch.equal(torch.cat([torch.ops.kvserve_native.linear_blocks(p, [panels], [rows], [kind_id])
                                      for p in x.split(m)]), full), m


def test_a_gguf_of_mxfp4_loads_as_stored(tmp_path):
    """A GGUF tensor gguf-py writes as MXFP4 is read as a StoredTensor of that type and served by its kernel;
    beside a Q8_0 tensor, one projection of two parts."""
    import gguf

    rng = np.random.default_rng(13)
    k, experts, dense = 256, 48, 16
    writer = gguf.GGUFWriter(str(tmp_path / "mx.gguf"), "llama")
    writer.add_tensor("experts", quantized(experts, k, rng), raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    q8 = gguf.quants.quantize(rng.standard_normal((dense, k)).astype(np.float32) * 0.05, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("dense", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(tmp_path / "mx.gguf"))
    stored = [StoredTensor(t.name, tmp_path / "mx.gguf", int(t.data_offset), t.tensor_type.name,
                           tuple(int(x) for x in reversed(t.shape.tolist()))) for t in reader.tensors]
    assert [(t.type, t.shape) for t in stored] == [("MXFP4", (experts, k)), ("Q8_0", (dense, k))]
    stored[0].check_type()
    assert torch.equal(stored[0].dequantize(), torch.from_numpy(gguf.quants.dequantize(reader.tensors[0].data, reader.tensors[0].tensor_type)))
    linear = LinearBlocks.from_stored(stored, None)
    assert linear.sources == ("MXFP4", "Q8_0") and linear.kinds == ("mxfp4", "q8") and linear.ns == (experts, dense)
    weight = torch.cat([t.dequantize() for t in stored])
    assert torch.equal(linear.weight(), weight)
    x = torch.randn(3, k)
    assert float((linear(x) - x @ weight.T).norm() / (x @ weight.T).norm()) < 1e-4
