"""kvserve's own GGUF header reader (models/gguf_file.py) reads what gguf-py's GGUFReader reads: every
metadata value and every tensor's shape, type and place, on the default model's file and on a file with
arrays of every number type; damaged files are refused with a clear error."""
import numpy as np
import pytest

from models import ModelLoadError
from models.gguf_file import read_header


def reference(path):
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = [(t.name, tuple(int(x) for x in t.shape.tolist()), t.tensor_type.name, int(t.data_offset), int(t.n_bytes))
               for t in reader.tensors]
    return meta, tensors


def assert_reads_alike(path):
    meta, tensors = read_header(path)
    want_meta, want_tensors = reference(path)
    assert meta.keys() == want_meta.keys()
    for key, value in want_meta.items():
        assert meta[key] == value, key
    assert [(t.name, t.shape, t.type_name, t.data_offset, t.n_bytes) for t in tensors] == want_tensors


def test_the_default_models_file_reads_as_gguf_py_reads_it(smollm_path):
    assert_reads_alike(smollm_path)
    meta, tensors = read_header(smollm_path)
    assert len(meta["tokenizer.ggml.tokens"]) == 49152 and len(tensors) == 272


def test_every_value_type_reads_alike(tmp_path):
    import gguf

    path = tmp_path / "values.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200), w.add_int8("t.i8", -5), w.add_uint16("t.u16", 60000), w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000), w.add_int32("t.i32", -7), w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 2**60), w.add_int64("t.i64", -(2**40)), w.add_float64("t.f64", 1e-300), w.add_bool("t.b", True)
    w.add_string("t.s", "héllo"), w.add_array("t.strings", ["a", "", "ü"]), w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.5]), w.add_array("t.bools", [True, False])
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("b.weight", rng.standard_normal((5, 32)).astype(np.float16))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    assert_reads_alike(path)
    meta, tensors = read_header(path)
    assert meta["t.s"] == "héllo" and meta["t.strings"] == ["a", "", "ü"] and meta["t.i64"] == -(2**40)
    assert [(t.name, t.shape, t.type_name) for t in tensors] == [("a.weight", (64, 3), "F32"), ("b.weight", (32, 5), "F16")]


@pytest.mark.parametrize("damage", ["magic", "truncated", "version"])
def test_damaged_headers_are_refused(smollm_path, tmp_path, damage):
    data = bytearray(smollm_path.read_bytes()[: 1 << 20])
    if damage == "magic":
        data[:4] = b"GGUG"
    elif damage == "version":
        data[4:8] = (7).to_bytes(4, "little")
    else:
        data = data[:5000]  # inside the vocabulary
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="not a valid GGUF file"):
        read_header(path)
