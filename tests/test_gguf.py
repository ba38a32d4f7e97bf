"""The GGUF reader against gguf-py (writer and reader) as the oracle."""

from __future__ import annotations

import errno
import math
import os
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ds4
from conftest import ALL_TYPES, block_geometry, random_row, write_gguf

VT = gguf.GGUFValueType

# ---------------------------------------------------------------------------------------------
# A real file written by llama.cpp's converter


def test_llamacpp_file_matches_gguf_py(llamacpp_tiny_l: Path) -> None:
    f = ds4.GGUFFile(llamacpp_tiny_l)
    ref = gguf.GGUFReader(llamacpp_tiny_l)
    assert f.version == 3
    assert f.metadata["general.architecture"] == "deepseek4"

    ref_fields = {k: v for k, v in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(f.metadata) == list(ref_fields)
    for key, field in ref_fields.items():
        want = field.contents()
        got = f.metadata[key]
        if field.types[-1] == VT.FLOAT32:
            assert np.array_equal(np.asarray(got, dtype=np.float32), np.asarray(want, dtype=np.float32)), key
        else:
            assert got == want, key
    assert f.metadata_types["deepseek4.attention.compress_ratios"] == "array[i32]"
    assert f.metadata_types["deepseek4.expert_weights_norm"] == "bool"

    assert list(f.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        info = f.tensors[t.name]
        assert info.type == t.tensor_type.name
        assert info.dims == [int(d) for d in t.shape]
        assert info.offset == t.data_offset
        assert info.nbytes == t.n_bytes
        got = f.read(t.name)
        want = np.asarray(t.data)
        assert got.shape == want.shape
        assert got.dtype == (np.int32 if t.tensor_type.name == "I32" else np.float32)
        assert np.array_equal(got, want), t.name
        assert f.read_raw(t.name) == bytes(np.asarray(t.data).tobytes())


def test_read_returns_writable_arrays(llamacpp_tiny_l: Path) -> None:
    f = ds4.GGUFFile(llamacpp_tiny_l)
    a = f.read("output_norm.weight")
    a[0] += 1.0  # writable: a private copy, not a view of the map
    assert f.read("output_norm.weight")[0] == a[0] - 1.0


def test_missing_tensor_and_file(llamacpp_tiny_l: Path, tmp_path: Path) -> None:
    f = ds4.GGUFFile(llamacpp_tiny_l)
    with pytest.raises(KeyError, match="nope"):
        f.read("nope")
    with pytest.raises(FileNotFoundError) as e:
        ds4.GGUFFile(tmp_path / "absent.gguf")
    # The fields and text of Python's own error for a missing file.
    assert e.value.errno == errno.ENOENT and e.value.strerror == os.strerror(errno.ENOENT)
    assert e.value.filename == str(tmp_path / "absent.gguf")
    with pytest.raises(OSError):
        ds4.GGUFFile(tmp_path)


# ---------------------------------------------------------------------------------------------
# Round trips of files written by gguf.GGUFWriter

SCALARS: dict[VT, st.SearchStrategy[Any]] = {
    VT.UINT8: st.integers(0, 2**8 - 1),
    VT.INT8: st.integers(-(2**7), 2**7 - 1),
    VT.UINT16: st.integers(0, 2**16 - 1),
    VT.INT16: st.integers(-(2**15), 2**15 - 1),
    VT.UINT32: st.integers(0, 2**32 - 1),
    VT.INT32: st.integers(-(2**31), 2**31 - 1),
    VT.UINT64: st.integers(0, 2**64 - 1),
    VT.INT64: st.integers(-(2**63), 2**63 - 1),
    VT.FLOAT32: st.floats(width=32, allow_nan=False),
    VT.FLOAT64: st.floats(allow_nan=False),
    VT.BOOL: st.booleans(),
    VT.STRING: st.text(max_size=20),
}


@st.composite
def metadata_value(draw: st.DrawFn) -> tuple[Any, VT, VT | None]:
    kind = draw(st.sampled_from([*SCALARS, VT.ARRAY, "nested"]))
    if kind == VT.ARRAY:
        sub = draw(st.sampled_from(list(SCALARS)))
        return draw(st.lists(SCALARS[sub], min_size=1, max_size=6)), VT.ARRAY, sub
    if kind == "nested":
        # Inner arrays are typed by gguf-py from their first item: use strings and ints
        # (packed as INT32) so the expected type is unambiguous.
        inner = st.one_of(st.lists(st.text(max_size=5), min_size=1, max_size=3),
                          st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=3))
        return draw(st.lists(inner, min_size=1, max_size=3)), VT.ARRAY, None
    return draw(SCALARS[kind]), kind, None


def same_value(got: Any, want: Any, vtype: VT) -> bool:
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(
            same_value(g, w, vtype) for g, w in zip(got, want))
    if vtype == VT.FLOAT32:
        return bool(np.float32(got) == np.float32(want)) or (math.isnan(got) and math.isnan(want))
    return bool(got == want) and type(got) is type(want)


@st.composite
def tensor_spec(draw: st.DrawFn) -> tuple[str, int, int]:
    name = draw(st.sampled_from(ALL_TYPES + ["I8", "I16", "I32", "I64", "F64", "Q6_K"]))
    be, _ = block_geometry(name)
    return name, draw(st.integers(1, 3)) * max(be, 1) * (1 if be > 1 else draw(st.integers(1, 5))), draw(st.integers(1, 3))


def make_tensor(rng: np.random.Generator, name: str, row: int, rows: int) -> tuple[np.ndarray, str | None]:
    if name in ("I8", "I16", "I32", "I64"):
        dt = {"I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}[name]
        return rng.integers(-100, 100, size=(rows, row)).astype(dt), None
    if name == "F64":
        return rng.standard_normal((rows, row)), None
    if name == "Q6_K":
        _, bb = block_geometry(name)
        return rng.integers(0, 256, size=(rows, row // 256 * bb), dtype=np.uint8), "Q6_K"
    data = np.stack([random_row(rng, name, row) for _ in range(rows)])
    return data, name


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    meta=st.dictionaries(st.text(min_size=1, max_size=12).map(lambda s: "k." + s), metadata_value(), max_size=8),
    specs=st.lists(tensor_spec(), max_size=6),
    alignment=st.sampled_from([None, 1, 8, 64, 256]),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_gguf_writer(tmp_path: Path, meta: dict[str, Any], specs: list[tuple[str, int, int]],
                                alignment: int | None, seed: int) -> None:
    rng = np.random.default_rng(seed)
    tensors = []
    for i, (name, row, rows) in enumerate(specs):
        arr, raw = make_tensor(rng, name, row, rows)
        tensors.append((f"t{i}.{name}", arr, raw))
    path = tmp_path / f"rt-{seed}.gguf"
    write_gguf(path, [(k, v, t, s) for k, (v, t, s) in meta.items()], tensors, alignment)

    f = ds4.GGUFFile(path)
    ref = gguf.GGUFReader(path)
    assert f.alignment == (alignment or 32)
    for key, (value, vtype, sub) in meta.items():
        assert same_value(f.metadata[key], value, sub or vtype), key
    assert f.metadata["general.architecture"] == "test"
    assert list(f.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        info = f.tensors[t.name]
        assert info.offset == t.data_offset and info.offset % f.alignment == 0
        assert info.nbytes == t.n_bytes
        assert f.read_raw(t.name) == np.asarray(t.data).tobytes()
        if info.type == "Q6_K":
            with pytest.raises(ds4.UnsupportedModelError, match="Q6_K"):
                f.read(t.name)
            continue
        got = f.read(t.name)
        if info.type in ("I8", "I16", "I32", "I64", "F64"):
            want = np.asarray(t.data)
        else:
            want = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(got.shape)
        assert got.shape == tuple(int(d) for d in reversed(t.shape))
        assert np.array_equal(got.view(np.uint8), want.astype(got.dtype).view(np.uint8)), t.name


# ---------------------------------------------------------------------------------------------
# Malformed files: every error is a GGUFError, never a crash


@pytest.fixture(scope="module")
def valid_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, dict[str, int]]:
    """A valid file with metadata of every kind and tensors of several types, and the byte
    offsets where its header regions start."""
    rng = np.random.default_rng(7)
    path = tmp_path_factory.mktemp("valid") / "valid.gguf"
    meta = [
        ("a.u32", 7, VT.UINT32, None),
        ("a.str", "héllo", VT.STRING, None),
        ("a.f32s", [1.5, -2.0], VT.ARRAY, VT.FLOAT32),
        ("a.nested", [["x", "yz"], ["w"]], VT.ARRAY, None),
        ("a.bool", True, VT.BOOL, None),
    ]
    tensors = [
        ("w.f32", rng.standard_normal((2, 8)).astype(np.float32), None),
        ("w.q8", np.stack([random_row(rng, "Q8_0", 64)]), "Q8_0"),
        ("w.q2k", np.stack([random_row(rng, "Q2_K", 256)]), "Q2_K"),
        ("w.i32", np.arange(6, dtype=np.int32), None),
    ]
    write_gguf(path, meta, tensors)
    data = path.read_bytes()
    f = ds4.GGUFFile(path)
    first_tensor_name = data.index(b"w.f32") - 8
    regions = {
        "magic": 0, "version": 4, "counts": 8, "metadata": 24,
        "tensor_directory": first_tensor_name, "data": f.data_offset,
        "end": max(t.offset + t.nbytes for t in f.tensors.values()),
    }
    return data, regions


def open_bytes(tmp_path: Path, data: bytes, name: str = "m.gguf") -> ds4.GGUFFile:
    p = tmp_path / name
    p.write_bytes(data)
    return ds4.GGUFFile(p)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frac=st.floats(0, 1, exclude_max=True))
def test_truncation_is_a_gguf_error(tmp_path: Path, valid_file: tuple[bytes, dict[str, int]], frac: float) -> None:
    data, regions = valid_file
    cut = int(frac * regions["end"])
    with pytest.raises(ds4.GGUFError):
        open_bytes(tmp_path, data[:cut])


def test_every_header_truncation(tmp_path: Path, valid_file: tuple[bytes, dict[str, int]]) -> None:
    data, regions = valid_file
    for cut in range(regions["data"]):
        with pytest.raises(ds4.GGUFError):
            open_bytes(tmp_path, data[:cut])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(region=st.sampled_from(["magic", "version", "counts", "metadata", "tensor_directory"]),
       pos=st.floats(0, 1, exclude_max=True), flips=st.lists(st.integers(1, 255), min_size=1, max_size=4))
def test_byte_flips_in_header(tmp_path: Path, valid_file: tuple[bytes, dict[str, int]], region: str,
                              pos: float, flips: list[int]) -> None:
    data, regions = valid_file
    order = ["magic", "version", "counts", "metadata", "tensor_directory", "data"]
    start, end = regions[region], regions[order[order.index(region) + 1]]
    buf = bytearray(data)
    at = start + int(pos * (end - start))
    for i, x in enumerate(flips):
        if at + i < end:
            buf[at + i] ^= x
    try:
        f = open_bytes(tmp_path, bytes(buf))
    except ds4.GGUFError as e:
        assert isinstance(e, ValueError) and isinstance(e, ds4.Ds4Error)
        assert str(e)
        return
    # A flip the format cannot detect (a value byte, a name character): the file must still
    # be fully usable.
    for name, info in f.tensors.items():
        try:
            f.read(name)
        except ds4.UnsupportedModelError:
            pass
        assert info.offset + info.nbytes <= f.file_size


def header(version: int = 3, n_tensors: int = 0, n_kv: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype) + payload


def tinfo(name: str, dims: list[int], ttype: int, offset: int) -> bytes:
    n = name.encode()
    return (struct.pack("<Q", len(n)) + n + struct.pack("<I", len(dims))
            + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", ttype, offset))


def pad(b: bytes, align: int = 32) -> bytes:
    return b + b"\0" * (-len(b) % align)


MALFORMED = {
    "bad magic": (b"GGUX" + header()[4:], "not a GGUF file"),
    "version 1": (header(version=1), "unsupported GGUF version 1"),
    "version 4": (header(version=4), "unsupported GGUF version 4"),
    "big-endian version": (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "unsupported GGUF version"),
    "empty": (b"", "truncated"),
    "huge kv count": (header(n_kv=2**62), "metadata"),
    "huge tensor count": (header(n_tensors=2**61), "tensor"),
    "overflowing kv count": (header(n_kv=2**64 - 1), "overflow"),
    "unknown value type": (header(n_kv=1) + kv("k", 13, b""), "unknown value type id 13"),
    "unknown array type": (header(n_kv=1) + kv("k", 9, struct.pack("<IQ", 99, 1)), "unknown value type id 99"),
    "huge array": (header(n_kv=1) + kv("k", 9, struct.pack("<IQ", 4, 2**60)), "truncated"),
    "huge string": (header(n_kv=1) + kv("k", 8, struct.pack("<Q", 2**63)), "truncated"),
    "bad utf-8 key": (header(n_kv=1) + struct.pack("<Q", 2) + b"\xff\xfe" + struct.pack("<IB", 0, 1), "UTF-8"),
    "bad bool": (header(n_kv=1) + kv("k", 7, b"\x02"), "boolean"),
    "duplicate key": (header(n_kv=2) + kv("k", 0, b"\1") + kv("k", 0, b"\2"), "duplicate metadata key"),
    "deep nesting": (header(n_kv=1) + kv("k", 9, struct.pack("<IQ", 9, 1) * 40), "nested deeper"),
    "alignment zero": (header(n_kv=1) + kv("general.alignment", 4, struct.pack("<I", 0)), "alignment"),
    "alignment not power of two": (header(n_kv=1) + kv("general.alignment", 4, struct.pack("<I", 48)), "alignment"),
    "alignment wrong type": (header(n_kv=1) + kv("general.alignment", 10, struct.pack("<Q", 32)), "alignment"),
    "unknown tensor type": (pad(header(n_tensors=1) + tinfo("t", [4], 5, 0)) + b"\0" * 32, "unknown tensor type id 5"),
    "too many dims": (pad(header(n_tensors=1) + tinfo("t", [1] * 5, 0, 0)) + b"\0" * 32, "dimensions"),
    "dims overflow": (pad(header(n_tensors=1) + tinfo("t", [2**32, 2**32], 0, 0)), "overflows"),
    "row not whole blocks": (pad(header(n_tensors=1) + tinfo("t", [33], 8, 0)) + b"\0" * 64, "not a multiple"),
    "misaligned offset": (pad(header(n_tensors=1) + tinfo("t", [4], 0, 4)) + b"\0" * 64, "not a multiple of the alignment"),
    "offset out of bounds": (pad(header(n_tensors=1) + tinfo("t", [4], 0, 64)) + b"\0" * 32, "outside the data section"),
    "offset overflows": (pad(header(n_tensors=1) + tinfo("t", [4], 0, 2**64 - 32)) + b"\0" * 32, "outside"),
    "data truncated": (pad(header(n_tensors=1) + tinfo("t", [64], 0, 0)) + b"\0" * 100, "outside the data section"),
    "duplicate tensor": (pad(header(n_tensors=2) + tinfo("t", [4], 0, 0) + tinfo("t", [4], 0, 32)) + b"\0" * 64,
                         "duplicate tensor name"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_files(tmp_path: Path, case: str) -> None:
    data, message = MALFORMED[case]
    with pytest.raises(ds4.GGUFError, match=f"(?i){message}"):
        open_bytes(tmp_path, data)


def test_minimal_valid_files(tmp_path: Path) -> None:
    f = open_bytes(tmp_path, header(version=2))
    assert (f.version, f.metadata, f.tensors) == (2, {}, {})
    body = pad(header(n_tensors=1, n_kv=1) + kv("general.alignment", 4, struct.pack("<I", 64))
               + tinfo("t", [2, 2], 0, 0), 64) + struct.pack("<4f", 1, 2, 3, 4)
    f = open_bytes(tmp_path, body, "ok.gguf")
    assert f.alignment == 64 and f.data_offset == 128  # 98 header bytes, padded to 64
    assert f.read("t").tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert f.tensors["t"].shape == [2, 2] and f.tensors["t"].dims == [2, 2]


@pytest.mark.parametrize("path", sorted((Path(__file__).parent / "fuzz_regressions").glob("*")), ids=lambda p: p.name)
def test_fuzz_regressions(path: Path) -> None:
    # Inputs that once crashed the fuzz target: each must open (or fail) cleanly and be
    # fully readable.
    try:
        f = ds4.GGUFFile(path)
    except ds4.GGUFError:
        return
    for name, info in f.tensors.items():
        assert f.read(name).size == info.n_elements
