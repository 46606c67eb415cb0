"""The load's native repack of a file's blocks into panels (kernels/repack.cpp) against its Python reference
(formats/: each format's decode, then panels.pack): byte for byte for every format, the padding rows
included, read from a file (file_reads.py) in chunks and as stacked experts, and damaged blocks refused alike."""
import numpy as np
import pytest
import torch

from models import ModelLoadError
from models.expert_weights import held
from models.file_reads import ALIGN, read_buffer, read_into
from models.formats import DAMAGED, FORMATS, CorruptBlock
from models.formats.panels import panel_count
from models.quant import model_kernels_available
from models.stored import StoredTensor
from tests.models.gguf_files import SCALE_FIELDS, random_blocks

pytestmark = pytest.mark.skipif(not model_kernels_available(), reason="no AVX2 CPU or compiler here")

ROWS = (1, 13, 37, 1045)  # none fills whole panel groups of 16
# fp16 scales at the edges of the finite ones: the smallest subnormal, -0, the largest, a negative one
EDGE_HALVES = np.array([0x0001, 0x8000, 0x7BFF, 0xC0A0], dtype=np.uint16)


def blocks(gguf_type: str, rows: int, k: int, seed: int) -> np.ndarray:
    """Random blocks [rows, row bytes], some of their fp16 scales at the finite edges."""
    rng = np.random.default_rng(seed)
    raw = random_blocks(gguf_type, rows, k, rng)
    fmt = FORMATS[gguf_type]
    per_block = raw.reshape(rows, -1, fmt.bytes)
    for at in SCALE_FIELDS.get(gguf_type, ((),))[0]:
        picked = rng.random(per_block.shape[:2]) < 0.2
        values = rng.choice(EDGE_HALVES, size=int(picked.sum())).view(np.uint8).reshape(-1, 2)
        per_block[picked, at : at + 2] = values
    return raw


def repacked(gguf_type: str, raw: np.ndarray, native: bool) -> torch.Tensor:
    """Panels of raw rows, into a buffer first filled with a byte each path is unlikely to leave."""
    fmt = FORMATS[gguf_type]
    out = torch.full((panel_count(raw.shape[0]), fmt.units(raw.shape[1]), fmt.kind.bytes), 0xA5 if native else 0x5A,
                     dtype=torch.uint8)
    (fmt.repack if native else fmt.repack_python)(torch.from_numpy(raw.copy()), out)
    return out


@pytest.mark.parametrize("gguf_type", sorted(FORMATS))
def test_each_format_repacks_natively_as_in_python(gguf_type):
    for i, rows in enumerate(ROWS):
        raw = blocks(gguf_type, rows, 512, seed=i)
        want = repacked(gguf_type, raw, native=False)
        assert torch.equal(repacked(gguf_type, raw, native=True), want), rows
    # in chunks of whole panel groups, each written into its place of one tensor
    data = torch.from_numpy(raw.copy())
    chunked = FORMATS[gguf_type].panels(lambda r0, r1: data[r0:r1], rows, chunk_rows=48)
    assert torch.equal(chunked, want)


@pytest.mark.parametrize("gguf_type", sorted(SCALE_FIELDS.keys() & FORMATS.keys()))
def test_a_block_with_a_scale_not_finite_is_refused_alike(gguf_type):
    fmt = FORMATS[gguf_type]
    for at in SCALE_FIELDS[gguf_type][0]:
        for bad in (np.inf, -np.inf, np.nan):
            raw = blocks(gguf_type, 37, 512, seed=5)
            raw.reshape(37, -1, fmt.bytes)[29, 1, at : at + 2] = np.array([bad], dtype=np.float16).view(np.uint8)
            for native in (False, True):
                with pytest.raises(CorruptBlock, match=DAMAGED):
                    repacked(gguf_type, raw, native)


def test_mxfp4_exponents_at_both_ends_are_not_damage():
    """e = 255 is ggml's 2^127, not a NaN; e = 0 its smallest scale."""
    raw = blocks("MXFP4", 21, 256, seed=2)
    raw.reshape(21, -1, 17)[::2, :, 0] = 255
    raw.reshape(21, -1, 17)[1::2, ::3, 0] = 0
    assert torch.equal(repacked("MXFP4", raw, native=True), repacked("MXFP4", raw, native=False))


def stored(path, gguf_type: str, shape: tuple[int, ...], seed: int, damaged: bool = False) -> tuple[StoredTensor, np.ndarray]:
    """A tensor of random blocks written after a few bytes of something else in `path`."""
    rows = int(np.prod(shape[:-1]))
    raw = blocks(gguf_type, rows, shape[-1], seed)
    if damaged:
        at = SCALE_FIELDS[gguf_type][0][0]
        raw.reshape(rows, -1, FORMATS[gguf_type].bytes)[rows - 3, 0, at : at + 2] = np.array([np.nan], np.float16).view(np.uint8)
    path.write_bytes(b"header" + raw.tobytes())
    return StoredTensor(f"blk.0.{gguf_type}.weight", path, 6, gguf_type, shape), raw


@pytest.mark.parametrize("gguf_type", ["Q4_K", "Q6_K", "Q5_0"])
def test_a_stored_tensor_is_read_and_repacked_exactly(tmp_path, gguf_type):
    tensor, raw = stored(tmp_path / "w.bin", gguf_type, (301, 1024), seed=3)
    assert torch.equal(tensor.panels(), repacked(gguf_type, raw, native=False))
    damaged, _ = stored(tmp_path / "bad.bin", gguf_type, (301, 1024), seed=3, damaged=True)
    with pytest.raises(ModelLoadError, match=rf"tensor blk\.0\.{gguf_type}\.weight is damaged: {DAMAGED}"):
        damaged.panels()


@pytest.mark.parametrize("n", [48, 40])  # whole panel groups (one run for all experts), and not (one at a time)
def test_stacked_experts_are_each_experts_panels(tmp_path, n):
    e, k = 5, 512
    tensor, raw = stored(tmp_path / "experts.bin", "Q4_K", (e, n, k), seed=4)
    panels, kind, source = held(tensor, "stored")
    assert (kind, source) == (FORMATS["Q4_K"].kind.id, "Q4_K")
    per_expert = raw.reshape(e, n, -1)
    assert torch.equal(panels, torch.stack([repacked("Q4_K", per_expert[i], native=False) for i in range(e)]))


def test_reads_are_exact_at_any_offset_and_stop_at_the_end(tmp_path):
    """Direct reads (an aligned span around the bytes asked for) and plain ones give the same bytes; a read
    past the end gives nothing, and a stored tensor there says the file is truncated."""
    data = np.random.default_rng(6).integers(0, 256, size=3 * ALIGN + 123, dtype=np.uint8)
    path = tmp_path / "bytes.bin"
    path.write_bytes(data.tobytes())
    for offset, n in ((0, data.size), (5, ALIGN), (ALIGN - 1, ALIGN + 2), (data.size - 100, 100), (17, 0)):
        for buffer in (read_buffer(n), torch.empty(n, dtype=torch.uint8)):
            got = read_into(path, offset, n, buffer)
            assert got is not None and np.array_equal(got.numpy(), data[offset : offset + n]), (offset, n)
    assert read_into(path, data.size - 100, 101, read_buffer(101)) is None
    tensor = StoredTensor("blk.0.ffn_up.weight", path, 6, "Q8_0", (200, 64))  # 13,600 bytes: past the end
    with pytest.raises(ModelLoadError, match="truncated"):
        tensor.panels()
