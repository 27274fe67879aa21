"""Frames and tensors on the wire: magic, header length, JSON header, then a safetensors blob.

`decode_frame` validates the header and the blob's length only; `unpack_tensors` checks checksum,
layout, manifest and finiteness, so a receiver pays only for the tensors it actually uses.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Final

import numpy as np
import safetensors
import safetensors.torch
import torch
from pydantic import ValidationError

from protocols.errors import ProtocolError
from protocols.messages import (
    AnyMessage,
    DType,
    Message,
    TensorManifest,
    TensorSpec,
    dump_header,
    parse_header,
)

Tensors = dict[str, torch.Tensor]
"""Name-keyed tensors: what algorithms compute on and what a frame's blob carries."""

MAGIC: Final = b"PFL\x01"
DEFAULT_MAX_FRAME_BYTES: Final = 256 * 1024 * 1024
"""Frames above this are rejected unread; a 10M-parameter float32 model (~40 MB) fits easily."""

_PREFIX_BYTES: Final = len(MAGIC) + 4
_DTYPES: Final[dict[DType, tuple[torch.dtype, str]]] = {  # wire name: (torch, safetensors)
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
_FROM_TORCH: Final[dict[torch.dtype, DType]] = {dtype: name for name, (dtype, _) in _DTYPES.items()}
_FROM_SAFETENSORS: Final[dict[str, str]] = {code: name for name, (_, code) in _DTYPES.items()}
_Layout = Mapping[str, tuple[str, tuple[int, ...]]]


def describe_tensors(tensors: Mapping[str, torch.Tensor]) -> tuple[TensorSpec, ...]:
    """The manifest entries `tensors` would get, sorted by name: what a receiver should expect.

    Raises:
        ProtocolError: a tensor has an unsupported dtype.
    """
    specs = []
    for name in sorted(tensors):
        dtype = _FROM_TORCH.get(tensors[name].dtype)
        if dtype is None:
            msg = f"tensor {name!r} has unsupported dtype {tensors[name].dtype}"
            raise ProtocolError(msg)
        specs.append(TensorSpec(name=name, dtype=dtype, shape=tuple(tensors[name].shape)))
    return tuple(specs)


def pack_tensors(tensors: Mapping[str, torch.Tensor]) -> tuple[TensorManifest, bytes]:
    """Encode tensors as a safetensors blob plus the manifest a receiver verifies it against.

    Tensors are detached, moved to the CPU and made contiguous; names are sorted so equal inputs
    give equal bytes. An empty mapping gives an empty blob.

    Raises:
        ProtocolError: a tensor has an invalid name, an unsupported dtype, or a NaN/Inf value.
    """
    prepared: Tensors = {}
    specs: list[TensorSpec] = []
    for name in sorted(tensors):
        tensor = tensors[name].detach()
        dtype = _FROM_TORCH.get(tensor.dtype)
        if dtype is None:
            supported = ", ".join(_DTYPES)
            msg = f"tensor {name!r} has unsupported dtype {tensor.dtype}; use one of {supported}"
            raise ProtocolError(msg)
        tensor = tensor.cpu().contiguous()
        try:
            specs.append(TensorSpec(name=name, dtype=dtype, shape=tuple(tensor.shape)))
        except ValidationError as error:
            msg = f"invalid tensor name {name!r}: {error.errors()[0]['msg']}"
            raise ProtocolError(msg) from None
        prepared[name] = tensor
    _require_all_finite(prepared)
    blob = _serialize(prepared) if prepared else b""
    digest = hashlib.sha256(blob).hexdigest()
    return TensorManifest(tensors=tuple(specs), byte_length=len(blob), sha256=digest), blob


def unpack_tensors(
    manifest: TensorManifest, blob: bytes, *, expected: Sequence[TensorSpec] | None = None
) -> Tensors:
    """Decode a blob into writable CPU tensors, trusting nothing the sender wrote.

    Args:
        manifest: The manifest from the frame's header.
        blob: The frame's blob.
        expected: The tensors the receiver accepts (e.g. the shared model's manifest entries);
            when given, the manifest must list exactly these names, dtypes and shapes.

    Returns:
        The tensors in manifest order.

    Raises:
        ProtocolError: the manifest differs from `expected`, the blob's length or SHA-256 differs
            from the manifest, the blob is not safetensors, its tensors differ from the
            manifest, or a floating tensor holds NaN/Inf.
    """
    described = _layout(manifest.tensors, "manifest")
    if expected is not None:
        _compare(_layout(expected, "expected"), described, "expected", "manifest")
    if len(blob) != manifest.byte_length:
        msg = f"tensor blob has {len(blob)} bytes, the manifest says {manifest.byte_length}"
        raise ProtocolError(msg)
    if hashlib.sha256(blob).hexdigest() != manifest.sha256:
        msg = "tensor blob checksum mismatch: its SHA-256 differs from the manifest's"
        raise ProtocolError(msg)
    parsed = _parse(blob)
    found = {name: entry[:2] for name, entry in parsed.items()}
    _compare(described, found, "in the manifest", "blob")
    tensors: Tensors = {}
    for name, (dtype_name, shape) in described.items():
        tensors[name] = _tensor(parsed[name][2], _DTYPES[dtype_name][0], shape)
    _require_all_finite(tensors)
    return tensors


def encode_frame(header: Message, blob: bytes = b"") -> bytes:
    """Frame a message and its blob for one MQTT payload.

    Raises:
        ProtocolError: the blob's length differs from the header's manifest, or the message
            carries no manifest but a blob was given.
    """
    _check_blob(header, len(blob))
    encoded = dump_header(header)
    return b"".join((MAGIC, len(encoded).to_bytes(4, "big"), encoded, blob))


def decode_frame(
    data: bytes | memoryview, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> tuple[AnyMessage, bytes]:
    """Split an inbound payload into its validated header and its (unverified) blob.

    Tensors are not unpacked here, so a receiver can drop a frame it does not need cheaply.

    Raises:
        ProtocolError: the payload exceeds `max_bytes`, is too short, has the wrong magic, a header
            length beyond its end, a malformed or unsupported header, or a blob whose length does
            not match the header's manifest.
    """
    view = memoryview(data).cast("B")
    size = view.nbytes
    if size > max_bytes:
        msg = f"frame of {size} bytes exceeds the limit of {max_bytes} bytes"
        raise ProtocolError(msg)
    if size < _PREFIX_BYTES:
        msg = f"frame of {size} bytes is shorter than its {_PREFIX_BYTES}-byte prefix"
        raise ProtocolError(msg)
    magic = view[: len(MAGIC)].tobytes()
    if magic != MAGIC:
        msg = f"wrong magic {magic!r}; expected {MAGIC!r}"
        raise ProtocolError(msg)
    header_end = _PREFIX_BYTES + int.from_bytes(view[len(MAGIC) : _PREFIX_BYTES], "big")
    if header_end > size:
        msg = f"header length {header_end - _PREFIX_BYTES} runs beyond the {size}-byte frame"
        raise ProtocolError(msg)
    header = parse_header(bytes(view[_PREFIX_BYTES:header_end]))
    _check_blob(header, size - header_end)
    return header, bytes(view[header_end:])


def encode_tensors_frame(
    make_header: Callable[[TensorManifest], Message], tensors: Mapping[str, torch.Tensor]
) -> bytes:
    """Pack tensors and frame them under the header built from their manifest.

    Raises:
        ProtocolError: as `pack_tensors` and `encode_frame`.
    """
    manifest, blob = pack_tensors(tensors)
    return encode_frame(make_header(manifest), blob)


def decode_tensors_frame(
    data: bytes | memoryview,
    *,
    expected: Sequence[TensorSpec] | None = None,
    max_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> tuple[AnyMessage, Tensors]:
    """Decode a frame and unpack its tensors at once, for receivers that always need them.

    Raises:
        ProtocolError: as `decode_frame` and `unpack_tensors`, or the message carries no manifest.
    """
    header, blob = decode_frame(data, max_bytes=max_bytes)
    manifest = _manifest_of(header)
    if manifest is None:
        msg = f"a {header.kind!r} message carries no tensors"
        raise _error(msg, header)
    try:
        return header, unpack_tensors(manifest, blob, expected=expected)
    except ProtocolError as error:
        raise _error(str(error), header) from None


def _require_all_finite(tensors: Mapping[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        _require_finite(name, tensor)


def _require_finite(name: str, tensor: torch.Tensor) -> None:
    """Reject NaN/Inf; numpy's check costs microseconds where a torch reduction costs tens."""
    if not tensor.is_floating_point() or not tensor.numel():
        return
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16
        low, high = torch.aminmax(tensor)
        finite = math.isfinite(low.item()) and math.isfinite(high.item())
    else:
        finite = bool(np.isfinite(tensor.numpy()).all())
    if not finite:
        msg = f"tensor {name!r} contains NaN or Inf"
        raise ProtocolError(msg)


def _layout(specs: Sequence[TensorSpec], what: str) -> dict[str, tuple[DType, tuple[int, ...]]]:
    layout = {spec.name: (spec.dtype, tuple(spec.shape)) for spec in specs}
    if len(layout) != len(specs):
        names = [spec.name for spec in specs]
        twice = ", ".join(sorted({repr(name) for name in names if names.count(name) > 1}))
        msg = f"the {what} tensors name {twice} more than once"
        raise ProtocolError(msg)
    return layout


def _compare(described: _Layout, actual: _Layout, ref: str, where: str) -> None:
    """Require `actual` to hold exactly the tensors `described` lists, naming the first misfit."""
    missing = ", ".join(map(repr, sorted(described.keys() - actual.keys())))
    if missing:
        msg = f"missing tensor(s) {missing}: {ref} but absent from the {where}"
        raise ProtocolError(msg)
    unknown = ", ".join(map(repr, sorted(actual.keys() - described.keys())))
    if unknown:
        msg = f"unknown tensor(s) {unknown} in the {where}: not {ref}"
        raise ProtocolError(msg)
    for name, found in actual.items():
        for field, got, want in zip(("dtype", "shape"), found, described[name], strict=True):
            if got != want:
                msg = f"tensor {name!r} has {field} {got} in the {where}; {ref}: {want}"
                raise ProtocolError(msg)


def _serialize(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """The safetensors layout, written directly, several times faster for small tensors.

    An 8-byte header length, a JSON header padded to 8 bytes, then each tensor's little-endian
    bytes: exactly what `safetensors.torch.save` writes, and read back by the same parser.
    """
    header: dict[str, object] = {}
    chunks: list[bytes] = []
    offset = 0
    for name, tensor in tensors.items():
        raw = _raw_bytes(tensor)
        code = _DTYPES[_FROM_TORCH[tensor.dtype]][1]
        header[name] = {
            "dtype": code,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return b"".join([struct.pack("<Q", len(text)), text, *chunks])


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16; the bits are what travel
        tensor = tensor.view(torch.int16)
    array = tensor.numpy()
    if sys.byteorder != "little":
        array = array.byteswap()
    return array.tobytes()


def _parse(blob: bytes) -> dict[str, tuple[str, tuple[int, ...], bytes | bytearray]]:
    """Let safetensors check the blob's layout; return each tensor's dtype, shape and bytes."""
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


def _tensor(data: bytes | bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A writable tensor over the parsed bytes (a bytearray, or bytes in older safetensors)."""
    buffer = data if isinstance(data, bytearray) else bytearray(data)
    if not buffer:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype).reshape(shape)


def _manifest_of(header: Message) -> TensorManifest | None:
    manifest = getattr(header, "manifest", None)
    return manifest if isinstance(manifest, TensorManifest) else None


def _error(message: str, header: Message) -> ProtocolError:
    """A ProtocolError carrying the device and round the header names, if any."""
    device_id = getattr(header, "device_id", None)
    round_id = getattr(header, "round_id", None)
    return ProtocolError(
        message,
        device_id=device_id if isinstance(device_id, str) else None,
        round_id=round_id if isinstance(round_id, int) else None,
    )


def _check_blob(header: Message, blob_length: int) -> None:
    manifest = _manifest_of(header)
    expected = "no blob (no manifest)" if manifest is None else f"{manifest.byte_length} bytes"
    if blob_length != (0 if manifest is None else manifest.byte_length):
        msg = f"blob of {blob_length} bytes on a {type(header).__name__}; expected {expected}"
        raise _error(msg, header)


def model_digest(model: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over names, dtypes, shapes and bytes: equal digests mean equal models."""
    hasher = hashlib.sha256()
    for name in sorted(model):
        value = model[name].detach().contiguous()
        hasher.update(f"{name}|{value.dtype}|{tuple(value.shape)}|".encode())
        hasher.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return hasher.hexdigest()


def join_owners(models: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Several devices' tensors in one frame: `<owner>/<name>` (relays and contributions)."""
    return {
        f"{owner}/{name}": value
        for owner, tensors in models.items()
        for name, value in tensors.items()
    }


def split_owners(tensors: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """`join_owners` undone: the tensors by owner, in the frame's order.

    Owner ids are single topic segments (no "/"), so the first "/" separates owner and name.
    """
    models: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        owner, _, name = key.partition("/")
        models.setdefault(owner, {})[name] = value
    return models
