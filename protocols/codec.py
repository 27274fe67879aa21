"""Frames and tensors on the wire: magic, header length, JSON header, then a safetensors blob.

`decode_frame` validates the header and the blob's length only; `unpack_tensors` checks checksum,
layout, manifest and finiteness, so a receiver pays only for the tensors it actually uses. The
blob itself is written and read in `protocols.tensor_blob`.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Final

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
from protocols.tensor_blob import (
    FROM_TORCH,
    WIRE_DTYPES,
    as_tensor,
    read_blob,
    read_written,
    require_all_finite,
    write_blob,
)

Tensors = dict[str, torch.Tensor]
"""Name-keyed tensors: what algorithms compute on and what a frame's blob carries."""

MAGIC: Final = b"PFL\x01"
DEFAULT_MAX_FRAME_BYTES: Final = 256 * 1024 * 1024
"""Frames above this are rejected unread; a 10M-parameter float32 model (~40 MB) fits easily."""

_PREFIX_BYTES: Final = len(MAGIC) + 4
_Layout = Mapping[str, tuple[str, tuple[int, ...]]]


def describe_tensors(tensors: Mapping[str, torch.Tensor]) -> tuple[TensorSpec, ...]:
    """The manifest entries `tensors` would get, sorted by name: what a receiver should expect.

    Raises:
        ProtocolError: a tensor has an unsupported dtype or an invalid name.
    """
    return tuple(_spec_of(name, tensors[name]) for name in sorted(tensors))


def pack_tensors(tensors: Mapping[str, torch.Tensor]) -> tuple[TensorManifest, bytes]:
    """Encode tensors as a safetensors blob plus the manifest a receiver verifies it against.

    Tensors are detached, moved to the CPU and made contiguous; names are sorted so equal inputs
    give equal bytes. An empty mapping gives an empty blob.

    Raises:
        ProtocolError: a tensor has an invalid name, an unsupported dtype, or a NaN/Inf value.
    """
    prepared = {name: tensors[name].detach().cpu().contiguous() for name in sorted(tensors)}
    specs = tuple(_spec_of(name, tensor) for name, tensor in prepared.items())
    blob = write_blob(prepared)
    digest = hashlib.sha256(blob).hexdigest()
    return TensorManifest(tensors=specs, byte_length=len(blob), sha256=digest), blob


def _spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    dtype = FROM_TORCH.get(tensor.dtype)
    if dtype is None:
        supported = ", ".join(WIRE_DTYPES)
        msg = f"tensor {name!r} has unsupported dtype {tensor.dtype}; use one of {supported}"
        raise ProtocolError(msg)
    return _spec(name, dtype, tuple(tensor.shape))


@functools.lru_cache(maxsize=4096)
def _spec(name: str, dtype: DType, shape: tuple[int, ...]) -> TensorSpec:
    """A validated manifest entry; a model's layout recurs every round, so each is made once."""
    try:
        return TensorSpec(name=name, dtype=dtype, shape=shape)
    except ValidationError as error:
        msg = f"invalid tensor name {name!r}: {error.errors()[0]['msg']}"
        raise ProtocolError(msg) from None


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
    if expected is not None:
        require_layout(manifest, expected)
    described = _layout(manifest.tensors, "manifest")
    if len(blob) != manifest.byte_length:
        msg = f"tensor blob has {len(blob)} bytes, the manifest says {manifest.byte_length}"
        raise ProtocolError(msg)
    if hashlib.sha256(blob).hexdigest() != manifest.sha256:
        msg = "tensor blob checksum mismatch: its SHA-256 differs from the manifest's"
        raise ProtocolError(msg)
    written = read_written(blob, described)  # our writer's layout: no parse needed
    if written is not None:
        return written
    parsed = read_blob(blob)
    found = {name: entry[:2] for name, entry in parsed.items()}
    _compare(described, found, "in the manifest", "blob")
    require_all_finite(
        blob, [(name, dtype, parsed[name][2]) for name, (dtype, _) in described.items()]
    )
    return {
        name: as_tensor(parsed[name][2], dtype_name, shape)
        for name, (dtype_name, shape) in described.items()
    }


def require_layout(manifest: TensorManifest, expected: Sequence[TensorSpec]) -> None:
    """Require `manifest` to list exactly `expected`'s names, dtypes and shapes.

    Raises:
        ProtocolError: naming the first tensor missing, unknown or of another dtype or shape.
    """
    _compare(
        _layout(expected, "expected"), _layout(manifest.tensors, "manifest"), "expected", "manifest"
    )


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
    if actual == described:
        return
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


def _manifest_of(header: Message) -> TensorManifest | None:
    """The header's manifest, None for a message without one.

    Read from the message's fields: `getattr` of a field its class lacks (a status, a hello)
    goes through pydantic's `__getattr__` and an exception, tens of microseconds a frame.
    """
    manifest = vars(header).get("manifest")
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
