"""A frame's tensor blob: the safetensors layout, written directly and read back by safetensors.

Writing skips `safetensors.torch.save`, several times slower for small tensors: the JSON header
depends only on names, dtypes and shapes, so a layout sent every round is encoded once, together
with its plan for the finiteness check. NaN/Inf are refused in one numpy pass over each run of
adjacent floating tensors of one dtype, on the bytes as they go out or come in.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import safetensors
import torch

from protocols.errors import ProtocolError
from protocols.messages import DType

WIRE_DTYPES: Final[dict[DType, tuple[torch.dtype, str]]] = {  # wire name: (torch, safetensors)
    "float32": (torch.float32, "F32"),
    "float64": (torch.float64, "F64"),
    "float16": (torch.float16, "F16"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "int64": (torch.int64, "I64"),
    "int32": (torch.int32, "I32"),
    "int8": (torch.int8, "I8"),
    "uint8": (torch.uint8, "U8"),
    "bool": (torch.bool, "BOOL"),
}
FROM_TORCH: Final[dict[torch.dtype, DType]] = {
    dtype: name for name, (dtype, _) in WIRE_DTYPES.items()
}
_FROM_SAFETENSORS: Final[dict[str, str]] = {code: name for name, (_, code) in WIRE_DTYPES.items()}
_CODES: Final[dict[torch.dtype, str]] = {dtype: code for dtype, code in WIRE_DTYPES.values()}
_FLOATING: Final[dict[str, str]] = {"F32": "<f4", "F64": "<f8", "F16": "<f2", "BF16": "<u2"}
"""Floating safetensors codes and the little-endian numpy type their bytes are read as."""
_NUMPY: Final[dict[DType, type[np.generic]]] = {
    "float32": np.float32,
    "float64": np.float64,
    "float16": np.float16,
    "int64": np.int64,
    "int32": np.int32,
    "int8": np.int8,
    "uint8": np.uint8,
    "bool": np.bool_,
}
"""The wire dtypes numpy has (all but bfloat16), in this machine's byte order as torch reads."""
_HEADER_LENGTH_BYTES: Final = 8
_BF16_EXPONENT: Final = 0x7F80
"""bfloat16 (which numpy lacks) is NaN or Inf exactly when its exponent bits are all set."""

RawBytes = bytes | bytearray | memoryview
Entry = tuple[str, tuple[int, ...], bytearray | bytes]
"""A parsed tensor: its wire dtype name (or an unknown code as is), shape and bytes."""


@dataclass(frozen=True)
class _Run:
    """Adjacent floating tensors of one dtype: checked in one pass over bytes [begin, end)."""

    code: str
    begin: int
    end: int
    members: tuple[tuple[str, int, int], ...]


@dataclass(frozen=True)
class _BlobLayout:
    header: bytes
    runs: tuple[_Run, ...]
    entries: tuple[tuple[str, tuple[int, ...], int], ...]
    """Each tensor's name, shape and first byte in the data."""
    data_bytes: int
    aligned: bool
    """Every tensor starts at a multiple of its item size (numpy can view it in place)."""


def write_blob(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """The safetensors bytes of CPU-contiguous tensors of wire dtypes, in the mapping's order.

    An 8-byte header length, a JSON header padded to 8 bytes, then each tensor's little-endian
    bytes: the layout safetensors reads (for tensors of one dtype, byte for byte what
    `safetensors.torch.save` writes). An empty mapping gives b"".

    Raises:
        ProtocolError: a floating tensor holds NaN or Inf (the first such tensor is named).
    """
    if not tensors:
        return b""
    layout = _layout_of(
        tuple((name, _CODES[t.dtype], tuple(t.shape)) for name, t in tensors.items())
    )
    blob = b"".join([layout.header, *(_raw(tensor) for tensor in tensors.values())])
    data = memoryview(blob)[len(layout.header) :]
    for run in layout.runs:
        if not _finite(data[run.begin : run.end], run.code):
            for name, begin, end in run.members:
                _refuse_non_finite(name, run.code, data[begin:end])
    return blob


def read_blob(blob: bytes) -> dict[str, Entry]:
    """Let safetensors check the blob's layout; each tensor's dtype, shape and writable bytes.

    Raises:
        ProtocolError: the blob is not valid safetensors.
    """
    if not blob:
        return {}
    try:
        entries = safetensors.deserialize(blob)  # type: ignore[no-untyped-call]
    except Exception as error:  # the parser's error types vary across safetensors releases
        msg = f"tensor blob is not valid safetensors: {error}"
        raise ProtocolError(msg) from None
    return {
        name: (
            _FROM_SAFETENSORS.get(item["dtype"], item["dtype"]),
            tuple(item["shape"]),
            item["data"],
        )
        for name, item in entries
    }


def read_written(
    blob: bytes, layout: Mapping[str, tuple[DType, tuple[int, ...]]]
) -> dict[str, torch.Tensor] | None:
    """The tensors of a blob laid out byte for byte as `write_blob` writes `layout`, else None.

    Such a blob (what every device's writer sends) holds exactly the tensors `read_blob` would
    find in it, so they are cut from one copy of its data without parsing its header; the
    finiteness check is the same. Any other blob gets None: read it with `read_blob`.

    Raises:
        ProtocolError: a floating tensor holds NaN or Inf (the first in `layout`'s order).
    """
    if not blob or not layout:
        return None
    key = tuple((name, WIRE_DTYPES[dtype][1], shape) for name, (dtype, shape) in layout.items())
    written = _layout_of(key)
    header = written.header
    if not written.aligned or len(blob) != len(header) + written.data_bytes:
        return None
    if blob[: len(header)] != header:
        return None
    data = memoryview(blob)[len(header) :]
    for run in written.runs:
        if not _finite(data[run.begin : run.end], run.code):
            for name, begin, end in run.members:
                _refuse_non_finite(name, run.code, data[begin:end])
    buffer = bytearray(data)
    return {
        name: _view(buffer, layout[name][0], shape, begin) for name, shape, begin in written.entries
    }


def _view(buffer: bytearray, dtype: DType, shape: tuple[int, ...], begin: int) -> torch.Tensor:
    """A writable tensor over `buffer` from byte `begin` (what `as_tensor` gives, in place)."""
    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=WIRE_DTYPES[dtype][0])
    numpy_dtype = _NUMPY.get(dtype)
    if numpy_dtype is None:  # bfloat16
        wire = WIRE_DTYPES[dtype][0]
        return torch.frombuffer(buffer, dtype=wire, count=count, offset=begin).reshape(shape)
    array = np.frombuffer(buffer, dtype=numpy_dtype, count=count, offset=begin)
    return torch.from_numpy(array.reshape(shape))


def as_tensor(data: bytes | bytearray, dtype: DType, shape: tuple[int, ...]) -> torch.Tensor:
    """A writable tensor over a read tensor's bytes (a bytearray, or bytes in older safetensors).

    Through numpy where it has the dtype: cheaper than `torch.frombuffer` and a reshape.
    """
    buffer = data if isinstance(data, bytearray) else bytearray(data)
    if not buffer:
        return torch.empty(shape, dtype=WIRE_DTYPES[dtype][0])
    numpy_dtype = _NUMPY.get(dtype)
    if numpy_dtype is None:  # bfloat16
        return torch.frombuffer(buffer, dtype=WIRE_DTYPES[dtype][0]).reshape(shape)
    return torch.from_numpy(np.frombuffer(buffer, dtype=numpy_dtype).reshape(shape))


def require_all_finite(blob: bytes, tensors: Sequence[tuple[str, DType, RawBytes]]) -> None:
    """Refuse a read blob whose floating tensors hold NaN or Inf.

    `tensors` lists every tensor of the blob (name, wire dtype, bytes), as checked against its
    manifest. When they share one floating dtype (most models), the blob's data, which
    safetensors has checked to be exactly their bytes end to end, is scanned in one pass.

    Raises:
        ProtocolError: naming the first such tensor in `tensors`' order.
    """
    codes = {WIRE_DTYPES[dtype][1] for _, dtype, _ in tensors}
    if len(codes) == 1 and (code := codes.pop()) in _FLOATING:
        start = _HEADER_LENGTH_BYTES + int.from_bytes(blob[:_HEADER_LENGTH_BYTES], "little")
        if _finite(memoryview(blob)[start:], code):
            return
    for name, dtype, data in tensors:
        _refuse_non_finite(name, WIRE_DTYPES[dtype][1], data)


def _refuse_non_finite(name: str, code: str, data: RawBytes) -> None:
    if code in _FLOATING and not _finite(data, code):
        msg = f"tensor {name!r} contains NaN or Inf"
        raise ProtocolError(msg)


def _finite(data: RawBytes, code: str) -> bool:
    values = np.frombuffer(data, dtype=_FLOATING[code])
    if code == "BF16":
        return not bool(((values & _BF16_EXPONENT) == _BF16_EXPONENT).any())
    return bool(np.isfinite(values).all())


@functools.lru_cache(maxsize=256)
def _layout_of(key: tuple[tuple[str, str, tuple[int, ...]], ...]) -> _BlobLayout:
    """The safetensors header of a layout, and its runs of floating tensors by dtype."""
    header: dict[str, object] = {}
    runs: list[_Run] = []
    entries: list[tuple[str, tuple[int, ...], int]] = []
    offset = 0
    aligned = True
    for name, code, shape in key:
        end = offset + _item_size(code) * math.prod(shape)
        entries.append((name, shape, offset))
        aligned = aligned and offset % _item_size(code) == 0
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, end]}
        if code in _FLOATING and end > offset:
            last = runs[-1] if runs else None
            if last is not None and last.code == code and last.end == offset:
                runs[-1] = _Run(code, last.begin, end, (*last.members, (name, offset, end)))
            else:
                runs.append(_Run(code, offset, end, ((name, offset, end),)))
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return _BlobLayout(
        len(text).to_bytes(_HEADER_LENGTH_BYTES, "little") + text,
        tuple(runs),
        tuple(entries),
        offset,
        aligned,
    )


def _item_size(code: str) -> int:
    return {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2}.get(code, 1)


def _raw(tensor: torch.Tensor) -> memoryview:
    """The tensor's little-endian bytes, in place (joined without another copy)."""
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16; the bits are what travel
        tensor = tensor.view(torch.int16)
    array = tensor.numpy()
    return (array.byteswap() if sys.byteorder != "little" else array).data
