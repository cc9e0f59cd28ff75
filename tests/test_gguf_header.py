"""The lean GGUF header reader gives what gguf-py's own GGUFReader gives: every
metadata value (arrays decoded on demand) and every tensor's type, shape,
offset and data view."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from infer.core.loader.gguf_header import GGUFHeader


def _same_as_gguf_reader(path) -> None:
    ours, theirs = GGUFHeader(path), gguf.GGUFReader(path)
    expected = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}  # its header pseudo-fields
    assert list(ours.fields) == list(expected)
    for key, field in expected.items():
        want, got = field.contents(), ours.fields[key].contents()
        assert got == want, key
        if isinstance(want, list):
            assert ours.fields[key].count == len(want)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, list(a.shape), a.n_elements, a.n_bytes, a.data_offset) == \
               (b.tensor_type, list(b.shape), b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data), a.name


def test_every_value_type_and_tensor_type_reads_as_gguf_py_reads_it(tmp_path):
    path = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -5)
    w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "Ünïcödé 🙂")
    w.add_array("t.ints", [1, 2, 3, 40000])
    w.add_array("t.floats", [0.5, -1.5])
    w.add_array("t.strs", ["a", "", "日本語"] * 50)
    w.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 2)).astype(np.float16))
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0):
        w.add_tensor(qtype.name, gguf.quants.quantize(rng.standard_normal((6, 64)).astype(np.float32), qtype),
                     raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _same_as_gguf_reader(path)


def test_nested_arrays_keep_their_structure_and_what_follows_them_is_read_in_place(tmp_path):
    """Arrays of arrays are walked to find where the next value starts. Their contents keep the
    nesting (gguf-py's reader flattens them, so only its tensor offsets are compared)."""
    path = tmp_path / "nested.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("t.ints", [[1, 2, 3], [4], [5, 6]])
    w.add_array("t.strs", [["a", "bc"], ["日本語"]])
    w.add_uint32("t.after", 7)
    w.add_tensor("f32", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = GGUFHeader(path), gguf.GGUFReader(path)
    assert ours.fields["t.ints"].contents() == [[1, 2, 3], [4], [5, 6]]
    assert ours.fields["t.strs"].contents() == [["a", "bc"], ["日本語"]]
    assert ours.fields["t.after"].contents() == 7
    assert [t.data_offset for t in ours.tensors] == [t.data_offset for t in theirs.tensors]
    np.testing.assert_array_equal(ours.tensors[0].data, np.arange(6, dtype=np.float32).reshape(2, 3))


@pytest.mark.slow
def test_smollm2_reads_as_gguf_py_reads_it():
    from conftest import require_smollm2

    require_smollm2()
    from infer.core.loader import resolve_model_path

    _same_as_gguf_reader(resolve_model_path("smollm2")[0])


def test_a_truncated_header_is_an_error_not_a_crash(tmp_path):
    path = tmp_path / "short.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("t.strs", ["word"] * 100)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 50])
    with pytest.raises(ValueError, match="truncated"):
        GGUFHeader(path)


@pytest.mark.parametrize("short_by", [1, 7])
def test_a_string_cut_short_by_a_few_bytes_is_an_error(tmp_path, short_by):
    """The last value is a string whose stored length runs `short_by` bytes past the end of the file
    (read whole first, where it ends exactly at the end)."""
    path = tmp_path / "short.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.name", "x" * 40)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    data = path.read_bytes()
    assert data.endswith(b"x" * 40)
    assert GGUFHeader(path).fields["general.name"].value == "x" * 40  # whole, ending at the last byte: fine
    path.write_bytes(data[: len(data) - short_by])
    with pytest.raises(ValueError, match="a string at byte .* runs past the end"):
        GGUFHeader(path)
