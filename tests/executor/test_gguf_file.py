"""Our GGUF reader against gguf's own `GGUFReader` (the reference), on the shipped model and on written files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from test_gguf import write_gguf

from pagedserve.services.executor.model.gguf_file import GGUFFile
from pagedserve.services.executor.model.registry import resolve_model


def assert_same_as_gguf(path: Path) -> GGUFFile:
    ours, reference = GGUFFile(path), gguf.GGUFReader(path)
    keys = [key for key in reference.fields if not key.startswith("GGUF.")]  # its header, as pseudo-keys
    assert list(ours.metadata) == keys
    for key in keys:
        value, expected = ours.metadata[key], reference.fields[key].contents()
        assert value == expected and type(value) is type(expected), key
        if isinstance(value, list) and value:
            assert {type(v) for v in value} == {type(v) for v in expected}, key
    assert len(ours.tensors) == len(reference.tensors)
    for tensor, expected_tensor in zip(ours.tensors, reference.tensors, strict=True):
        assert (tensor.name, tensor.tensor_type) == (expected_tensor.name, expected_tensor.tensor_type)
        assert tensor.shape == tuple(expected_tensor.shape.tolist())
        assert tensor.data.shape == expected_tensor.data.shape and not tensor.data.flags.writeable
        assert tensor.data.dtype.kind == expected_tensor.data.dtype.kind
        assert np.array_equal(tensor.data, expected_tensor.data), tensor.name
    return ours


def test_the_shipped_model_reads_as_gguf_reads_it() -> None:
    ours = assert_same_as_gguf(resolve_model("smollm2-135m").path)
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152
    assert {t.tensor_type for t in ours.tensors} >= {Q.F32, Q.Q8_0}


def write(path: Path, metadata: list[tuple[str, Any, V, V | None]], tensors: dict[str, tuple[np.ndarray, Q]],
          alignment: int | None = None) -> None:
    def configure(writer: gguf.GGUFWriter) -> None:
        if alignment is not None:
            writer.add_custom_alignment(alignment)
        for key, value, value_type, sub_type in metadata:
            writer.add_key_value(key, value, value_type, sub_type)

    write_gguf(path, "llama", tensors, {}, configure)


EVERY_TYPE = [
    ("u8", 200, V.UINT8, None), ("i8", -100, V.INT8, None), ("u16", 60000, V.UINT16, None),
    ("i16", -30000, V.INT16, None), ("u32", 4_000_000_000, V.UINT32, None), ("i32", -2_000_000_000, V.INT32, None),
    ("f32", 0.25, V.FLOAT32, None), ("u64", 2**63 + 5, V.UINT64, None), ("i64", -(2**62), V.INT64, None),
    ("f64", 1e-300, V.FLOAT64, None), ("yes", True, V.BOOL, None), ("no", False, V.BOOL, None),
    ("text", "héllo ✓", V.STRING, None), ("empty_text", "", V.STRING, None),
    ("ints", [1, -2, 3], V.ARRAY, V.INT32), ("floats", [0.5, -1.5], V.ARRAY, V.FLOAT32),
    ("bools", [True, False], V.ARRAY, V.BOOL), ("words", ["a", "", "ü", "Ġthe"], V.ARRAY, V.STRING),
]


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_and_tensor_type_reads_as_gguf_reads_it(tmp_path: Path, alignment: int | None) -> None:
    rng = np.random.default_rng(1)
    tensors = {f"t.{q.name}": (rng.normal(size=(2, 64)).astype(np.float32), q) for q in (Q.F32, Q.F16, Q.BF16,
                                                                                          Q.Q8_0, Q.Q4_0, Q.Q4_1)}
    write(tmp_path / "m.gguf", EVERY_TYPE, tensors, alignment)
    ours = assert_same_as_gguf(tmp_path / "m.gguf")
    for key, value, _, _ in EVERY_TYPE:
        assert ours.metadata[key] == pytest.approx(value) if key.startswith("f") else ours.metadata[key] == value
    assert ours.metadata.get("general.alignment") == alignment


def test_an_array_of_arrays_keeps_its_nesting(tmp_path: Path) -> None:
    path = tmp_path / "nested.gguf"
    write(path, [("nested", [[1, 2], [3]], V.ARRAY, V.ARRAY)], {})
    assert GGUFFile(path).metadata["nested"] == [[1, 2], [3]]  # gguf's reader flattens these (a FIXME of its own)


def test_files_that_are_not_gguf_are_refused_by_name(tmp_path: Path) -> None:
    write(tmp_path / "good.gguf", EVERY_TYPE, {"w": (np.ones((4, 32), np.float32), Q.F32)})
    data = (tmp_path / "good.gguf").read_bytes()
    cases = {
        "not a GGUF file": b"GGML" + data[4:],
        "version 7": data[:4] + (7).to_bytes(4, "little") + data[8:],
        "not a readable GGUF file": data[:12],  # cut inside the header's counts
        "a string runs past the end of the file": data[:200],  # cut inside the metadata
        "tensor 'w' runs past the end of the file": data[:-16],  # cut inside the tensor's data
    }
    for message, content in cases.items():
        path = tmp_path / "bad.gguf"
        path.write_bytes(content)
        with pytest.raises(ValueError, match=message):
            GGUFFile(path)
