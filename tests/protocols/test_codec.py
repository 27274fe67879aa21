"""Tests for the frame format and the tensor codec: round trips and every malformed class."""

from __future__ import annotations

import contextlib
import hashlib
import json

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols.codec import (
    DEFAULT_MAX_FRAME_BYTES,
    MAGIC,
    Tensors,
    decode_frame,
    decode_tensors_frame,
    encode_frame,
    encode_tensors_frame,
    pack_tensors,
    unpack_tensors,
)
from protocols.errors import ProtocolError
from protocols.messages import (
    DeviceStatus,
    DeviceUpdate,
    DType,
    SharedModel,
    TensorManifest,
    TensorSpec,
    dump_header,
)
from protocols.tensor_blob import read_written

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
SHAPES = [(), (0,), (2, 0, 3), (7,), (3, 4)]
FLOATS = ["float32", "float64", "float16", "bfloat16"]


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=generator, dtype=torch.float64) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=generator, dtype=torch.int64).to(
        dtype
    )


def update_header(manifest: TensorManifest) -> DeviceUpdate:
    return DeviceUpdate(
        run_id="ab" * 16,
        round_id=4,
        device_id="jetson-7",
        algorithm="fedavg",
        num_samples=120,
        train_loss=0.25,
        manifest=manifest,
    )


def model_tensors() -> Tensors:
    return {
        "layer.weight": make_tensor(torch.float32, (3, 4), seed=1),
        "layer.bias": make_tensor(torch.float32, (3,), seed=2),
        "steps": torch.tensor(5, dtype=torch.int64),
    }


def frame_with_header_bytes(header: bytes, blob: bytes = b"") -> bytes:
    return MAGIC + len(header).to_bytes(4, "big") + header + blob


def crafted_manifest(tensors: Tensors) -> tuple[TensorManifest, bytes]:
    """A blob written by safetensors directly (bypassing pack's checks) with a correct manifest."""
    blob = safetensors.torch.save(tensors)
    specs = tuple(
        TensorSpec.model_validate(
            {"name": name, "dtype": str(tensor.dtype).removeprefix("torch."), "shape": tensor.shape}
        )
        for name, tensor in sorted(tensors.items())
    )
    digest = hashlib.sha256(blob).hexdigest()
    return TensorManifest(tensors=specs, byte_length=len(blob), sha256=digest), blob


def flip_byte(data: bytes, index: int) -> bytes:
    return data[:index] + bytes([data[index] ^ 0xFF]) + data[index + 1 :]


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_frame_round_trip_preserves_every_dtype_and_shape(
    dtype_name: DType, shape: tuple[int, ...]
) -> None:
    # Prepare
    tensor = make_tensor(DTYPES[dtype_name], shape, seed=len(shape))
    tensors = {"t": tensor, "other": torch.arange(3, dtype=torch.int32)}

    # Execute
    frame = encode_tensors_frame(update_header, tensors)
    header, decoded = decode_tensors_frame(frame)

    # Assert
    assert isinstance(header, DeviceUpdate)
    assert header.manifest.tensors[1] == TensorSpec(name="t", dtype=dtype_name, shape=shape)
    assert decoded.keys() == tensors.keys()
    assert decoded["t"].dtype == DTYPES[dtype_name]
    assert decoded["t"].shape == shape
    assert torch.equal(decoded["t"], tensor)


def test_empty_mapping_gives_empty_blob_with_the_empty_digest() -> None:
    # Execute
    manifest, blob = pack_tensors({})

    # Assert
    assert blob == b""
    assert manifest.tensors == ()
    assert manifest.byte_length == 0
    assert manifest.sha256 == hashlib.sha256(b"").hexdigest()
    assert unpack_tensors(manifest, blob) == {}
    assert decode_tensors_frame(encode_tensors_frame(update_header, {}))[1] == {}


def test_pack_sorts_names_and_accepts_views_grads_and_shared_memory() -> None:
    # Prepare: a transposed view, a tensor needing grad, and one tensor under two names
    base = make_tensor(torch.float32, (3, 5), seed=3)
    tied = make_tensor(torch.float32, (4,), seed=4)
    weight = torch.nn.Parameter(make_tensor(torch.float32, (2,), seed=5))
    tensors = {"z.t": base.t(), "a.weight": weight, "m.tied": tied, "m.tied_again": tied}

    # Execute
    manifest, blob = pack_tensors(tensors)
    decoded = unpack_tensors(manifest, blob)

    # Assert
    assert [spec.name for spec in manifest.tensors] == sorted(tensors)
    assert list(decoded) == sorted(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(decoded[name], tensor.detach())
    assert not decoded["a.weight"].requires_grad


def test_unpacked_tensors_are_writable_and_independent() -> None:
    # Prepare
    manifest, blob = pack_tensors(model_tensors())

    # Execute
    first = unpack_tensors(manifest, blob)
    first["layer.bias"].add_(1.0)
    second = unpack_tensors(manifest, blob)

    # Assert
    assert torch.equal(second["layer.bias"], model_tensors()["layer.bias"])
    assert torch.equal(first["layer.bias"], model_tensors()["layer.bias"] + 1.0)


def test_pack_is_deterministic() -> None:
    # Execute
    first = pack_tensors(model_tensors())
    second = pack_tensors(dict(reversed(model_tensors().items())))

    # Assert
    assert first == second


def test_decode_frame_accepts_memoryview_and_defers_unpacking() -> None:
    # Prepare
    frame = encode_tensors_frame(update_header, model_tensors())

    # Execute
    header, blob = decode_frame(memoryview(frame))

    # Assert
    assert isinstance(header, DeviceUpdate)
    assert isinstance(blob, bytes)
    assert len(blob) == header.manifest.byte_length
    assert frame.endswith(blob)


def test_message_without_manifest_round_trips_with_empty_blob() -> None:
    # Prepare
    status = DeviceStatus(device_id="pi-3", state="training", round_id=2)

    # Execute
    header, blob = decode_frame(encode_frame(status))

    # Assert
    assert header == status
    assert blob == b""


def test_expected_specs_accept_the_matching_manifest() -> None:
    # Prepare
    manifest, blob = pack_tensors(model_tensors())
    expected = list(reversed(manifest.tensors))

    # Execute
    decoded = unpack_tensors(manifest, blob, expected=expected)

    # Assert
    assert decoded.keys() == model_tensors().keys()


def test_default_limit_fits_a_ten_million_parameter_float32_model() -> None:
    # Prepare
    manifest = TensorManifest(
        tensors=(TensorSpec(name="w", dtype="float32", shape=(10_000_000,)),),
        byte_length=40_000_128,
        sha256="0" * 64,
    )
    header = SharedModel(round_id=0, manifest=manifest)

    # Execute
    frame_size = len(encode_frame(header, bytes(manifest.byte_length)))

    # Assert
    assert frame_size < DEFAULT_MAX_FRAME_BYTES


# ---------------------------------------------------------------------------- pack rejects


@pytest.mark.parametrize("dtype_name", FLOATS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_pack_rejects_non_finite_values_naming_the_tensor(dtype_name: str, bad: float) -> None:
    # Prepare
    poisoned = torch.zeros(6, dtype=DTYPES[dtype_name])
    poisoned[4] = bad

    # Execute / Assert
    with pytest.raises(ProtocolError, match=r"'head.weight' contains NaN or Inf"):
        pack_tensors({"body.weight": torch.zeros(2), "head.weight": poisoned})


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int16, torch.float8_e4m3fn])
def test_pack_rejects_unsupported_dtype_naming_it(dtype: torch.dtype) -> None:
    # Execute / Assert
    with pytest.raises(ProtocolError, match=rf"'x' has unsupported dtype {dtype}"):
        pack_tensors({"x": torch.zeros(2).to(dtype)})


@pytest.mark.parametrize("name", ["", "has space", 'quote"', "x" * 257])
def test_pack_rejects_invalid_tensor_names(name: str) -> None:
    # Execute / Assert
    with pytest.raises(ProtocolError, match="invalid tensor name"):
        pack_tensors({name: torch.zeros(1)})


# ---------------------------------------------------------------------------- frame rejects


@pytest.fixture
def frame() -> bytes:
    return encode_tensors_frame(update_header, model_tensors())


def test_truncated_frame_is_rejected_for_its_short_blob(frame: bytes) -> None:
    # Execute / Assert
    with pytest.raises(ProtocolError, match=r"blob of \d+ bytes .* expected \d+ bytes") as caught:
        decode_frame(frame[:-1])
    assert caught.value.device_id == "jetson-7"
    assert caught.value.round_id == 4


@pytest.mark.parametrize("length", [0, 3, 7])
def test_frame_shorter_than_its_prefix_is_rejected(frame: bytes, length: int) -> None:
    # Execute / Assert
    with pytest.raises(ProtocolError, match="shorter than its 8-byte prefix"):
        decode_frame(frame[:length])


def test_wrong_magic_is_rejected(frame: bytes) -> None:
    # Execute / Assert
    with pytest.raises(ProtocolError, match="wrong magic"):
        decode_frame(b"PFL\x02" + frame[4:])


def test_oversized_frame_is_rejected_before_parsing(frame: bytes) -> None:
    # Prepare: bytes that would fail the magic check, were they parsed at all
    oversized = b"\xff" * (len(frame) + 1)

    # Execute / Assert
    with pytest.raises(ProtocolError, match=r"exceeds the limit of \d+ bytes"):
        decode_frame(oversized, max_bytes=len(frame))
    assert decode_frame(frame, max_bytes=len(frame))[0].kind == "update"


def test_header_length_beyond_the_data_is_rejected(frame: bytes) -> None:
    # Prepare
    lying = MAGIC + (len(frame)).to_bytes(4, "big") + frame[8:]

    # Execute / Assert
    with pytest.raises(ProtocolError, match=r"header length .* runs beyond"):
        decode_frame(lying)


@pytest.mark.parametrize(
    "header", [b"{not json", b"", b"[]", b'{"kind": "gossip"}', b'{"kind": "status"}']
)
def test_malformed_header_is_rejected(header: bytes) -> None:
    # Execute / Assert
    with pytest.raises(ProtocolError, match="malformed message"):
        decode_frame(frame_with_header_bytes(header))


def test_unsupported_protocol_version_is_rejected() -> None:
    # Prepare
    fields = json.loads(dump_header(DeviceStatus(device_id="pi-3", state="online")))
    fields["protocol_version"] = 99

    # Execute / Assert
    with pytest.raises(ProtocolError, match="unsupported protocol version 99"):
        decode_frame(frame_with_header_bytes(json.dumps(fields).encode()))


def test_blob_on_a_message_without_manifest_is_rejected() -> None:
    # Prepare
    header = dump_header(DeviceStatus(device_id="pi-3", state="online"))

    # Execute / Assert
    with pytest.raises(ProtocolError, match="no manifest"):
        decode_frame(frame_with_header_bytes(header, b"\x00\x01"))
    with pytest.raises(ProtocolError, match="no manifest"):
        encode_frame(DeviceStatus(device_id="pi-3", state="online"), b"\x00")


def test_encode_frame_rejects_a_blob_the_manifest_does_not_describe() -> None:
    # Prepare
    manifest, blob = pack_tensors(model_tensors())

    # Execute / Assert
    with pytest.raises(ProtocolError, match=r"expected .* bytes"):
        encode_frame(update_header(manifest), blob + b"\x00")


def test_tensors_frame_of_a_message_without_tensors_is_rejected() -> None:
    # Execute / Assert
    with pytest.raises(ProtocolError, match="'status' message carries no tensors"):
        decode_tensors_frame(encode_frame(DeviceStatus(device_id="pi-3", state="online")))


# ---------------------------------------------------------------------------- unpack rejects


def test_truncated_blob_is_rejected() -> None:
    # Prepare
    manifest, blob = pack_tensors(model_tensors())

    # Execute / Assert
    with pytest.raises(ProtocolError, match=rf"blob has {len(blob) - 1} bytes"):
        unpack_tensors(manifest, blob[:-1])


def test_flipped_blob_byte_fails_the_checksum() -> None:
    # Prepare
    manifest, blob = pack_tensors(model_tensors())

    # Execute / Assert
    with pytest.raises(ProtocolError, match="checksum mismatch"):
        unpack_tensors(manifest, flip_byte(blob, len(blob) - 3))


def test_checksum_failure_in_a_frame_carries_device_and_round(frame: bytes) -> None:
    # Execute / Assert
    with pytest.raises(ProtocolError, match="checksum mismatch") as caught:
        decode_tensors_frame(flip_byte(frame, len(frame) - 1))
    assert "device=jetson-7" in str(caught.value)
    assert "round=4" in str(caught.value)


def test_blob_that_is_not_safetensors_is_rejected() -> None:
    # Prepare: the checksum is right, the content is not
    blob = b"\x10\x00\x00\x00\x00\x00\x00\x00{broken json}   "
    manifest = TensorManifest(byte_length=len(blob), sha256=hashlib.sha256(blob).hexdigest())

    # Execute / Assert
    with pytest.raises(ProtocolError, match="not valid safetensors"):
        unpack_tensors(manifest, blob)


@pytest.mark.parametrize("dtype_name", FLOATS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_unpack_rejects_non_finite_values_in_a_crafted_blob(dtype_name: str, bad: float) -> None:
    # Prepare
    poisoned = torch.ones(2, 3, dtype=DTYPES[dtype_name])
    poisoned[1, 2] = bad
    manifest, blob = crafted_manifest({"fine": torch.ones(2), "poisoned": poisoned})

    # Execute / Assert
    with pytest.raises(ProtocolError, match="'poisoned' contains NaN or Inf"):
        unpack_tensors(manifest, blob)


@pytest.mark.parametrize("dtype_name", FLOATS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_unpack_rejects_non_finite_values_among_tensors_of_one_dtype(
    dtype_name: str, bad: float
) -> None:
    # Prepare: every tensor of one dtype, so the whole blob is checked in one pass
    dtype = DTYPES[dtype_name]
    poisoned = torch.ones(3, 2, dtype=dtype)
    poisoned[2, 1] = bad
    tensors = {"a": torch.ones(4, dtype=dtype), "b": poisoned, "c": torch.ones(5, dtype=dtype)}
    manifest, blob = crafted_manifest(tensors)

    # Execute / Assert
    with pytest.raises(ProtocolError, match="'b' contains NaN or Inf"):
        unpack_tensors(manifest, blob)


@pytest.mark.parametrize("dtype_name", FLOATS)
def test_pack_names_the_non_finite_tensor_among_neighbours_of_its_dtype(dtype_name: str) -> None:
    # Prepare: finite tensors of the same dtype on both sides, and an integer one in between
    dtype = DTYPES[dtype_name]
    poisoned = torch.zeros(7, dtype=dtype)
    poisoned[0] = float("nan")
    tensors = {
        "a": torch.ones(2, dtype=dtype),
        "b": poisoned,
        "c": torch.ones(3, dtype=dtype),
        "d.steps": torch.tensor(3),
        "e": torch.ones(1, dtype=dtype),
    }

    # Execute / Assert
    with pytest.raises(ProtocolError, match="'b' contains NaN or Inf"):
        pack_tensors(tensors)


def test_pack_writes_what_safetensors_writes_for_one_dtype() -> None:
    # Prepare
    tensors = {f"layer{i}.weight": make_tensor(torch.float32, (i + 1, 3), seed=i) for i in range(4)}

    # Execute
    _, blob = pack_tensors(tensors)

    # Assert: byte for byte, also on the second call (the layout's header is reused)
    assert blob == safetensors.torch.save(tensors)
    assert pack_tensors(tensors)[1] == blob


def _with_specs(manifest: TensorManifest, *specs: TensorSpec) -> TensorManifest:
    return manifest.model_copy(update={"tensors": specs})


def test_manifest_that_misdescribes_the_blob_is_rejected() -> None:
    # Prepare: a correct checksum over a blob whose tensors disagree with the manifest
    manifest, blob = pack_tensors({"a": torch.zeros(2, 3), "b": torch.zeros(4)})
    a, b = manifest.tensors
    cases = {
        "missing tensor\\(s\\) 'c': in the manifest but absent from the blob": _with_specs(
            manifest, a, b, TensorSpec(name="c", dtype="float32", shape=(1,))
        ),
        "unknown tensor\\(s\\) 'b' in the blob: not in the manifest": _with_specs(manifest, a),
        "'a' has shape \\(2, 3\\) in the blob; in the manifest: \\(3, 2\\)": _with_specs(
            manifest, a.model_copy(update={"shape": (3, 2)}), b
        ),
        "'b' has dtype float32 in the blob; in the manifest: int32": _with_specs(
            manifest, a, b.model_copy(update={"dtype": "int32"})
        ),
        "name 'a' more than once": _with_specs(manifest, a, a, b),
    }

    for message, lying in cases.items():
        # Execute / Assert
        with pytest.raises(ProtocolError, match=message):
            unpack_tensors(lying, blob)


@pytest.fixture
def packed() -> tuple[TensorManifest, bytes]:
    return pack_tensors(model_tensors())


def _expected(**changes: tuple[str, tuple[int, ...]] | None) -> list[TensorSpec]:
    layout: dict[str, tuple[str, tuple[int, ...]] | None] = {
        "layer.weight": ("float32", (3, 4)),
        "layer.bias": ("float32", (3,)),
        "steps": ("int64", ()),
    }
    layout.update(changes)
    return [
        TensorSpec.model_validate({"name": name, "dtype": entry[0], "shape": entry[1]})
        for name, entry in layout.items()
        if entry is not None
    ]


def test_wrong_shape_against_expected_is_rejected(packed: tuple[TensorManifest, bytes]) -> None:
    # Prepare
    expected = _expected(**{"layer.weight": ("float32", (4, 3))})

    # Execute / Assert
    with pytest.raises(ProtocolError, match=r"'layer.weight' has shape \(3, 4\) .*: \(4, 3\)"):
        unpack_tensors(*packed, expected=expected)


def test_wrong_dtype_against_expected_is_rejected(packed: tuple[TensorManifest, bytes]) -> None:
    # Prepare
    expected = _expected(steps=("int32", ()))

    # Execute / Assert
    with pytest.raises(ProtocolError, match=r"'steps' has dtype int64 in the manifest; .* int32"):
        unpack_tensors(*packed, expected=expected)


def test_unknown_tensor_against_expected_is_rejected(packed: tuple[TensorManifest, bytes]) -> None:
    # Prepare
    expected = _expected(steps=None)

    # Execute / Assert
    with pytest.raises(ProtocolError, match=r"unknown tensor\(s\) 'steps' in the manifest"):
        unpack_tensors(*packed, expected=expected)


def test_missing_tensor_against_expected_is_rejected(packed: tuple[TensorManifest, bytes]) -> None:
    # Prepare
    expected = _expected(**{"head.weight": ("float32", (2,))})

    # Execute / Assert
    with pytest.raises(ProtocolError, match=r"missing tensor\(s\) 'head.weight': expected"):
        unpack_tensors(*packed, expected=expected)


def test_expected_is_checked_through_decode_tensors_frame(frame: bytes) -> None:
    # Execute / Assert
    with pytest.raises(ProtocolError, match="'steps' has dtype int64"):
        decode_tensors_frame(frame, expected=_expected(steps=("float32", ())))


# ---------------------------------------------------------------------------- fuzzing

FUZZ = settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
VALID_FRAME = encode_tensors_frame(update_header, model_tensors())


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_raise_only_protocol_errors(data: bytes) -> None:
    # Execute / Assert
    with contextlib.suppress(ProtocolError):
        decode_tensors_frame(data)


@FUZZ
@given(st.binary(max_size=64))
def test_random_bytes_after_the_magic_raise_only_protocol_errors(data: bytes) -> None:
    # Execute / Assert
    with contextlib.suppress(ProtocolError):
        decode_tensors_frame(MAGIC + data)


@FUZZ
@given(
    cut=st.integers(min_value=0, max_value=len(VALID_FRAME)),
    flips=st.lists(st.tuples(st.integers(0, len(VALID_FRAME) - 1), st.integers(0, 7)), max_size=4),
)
def test_truncated_or_bit_flipped_frames_raise_only_protocol_errors(
    cut: int, flips: list[tuple[int, int]]
) -> None:
    # Prepare
    mutated = bytearray(VALID_FRAME)
    for index, bit in flips:
        mutated[index] ^= 1 << bit
    data = bytes(mutated[:cut])

    # Execute
    try:
        header, tensors = decode_tensors_frame(data)
    except ProtocolError:
        return

    # Assert: whatever survived every check is exactly what was sent
    assert isinstance(header, DeviceUpdate)
    assert all(torch.equal(tensors[name], value) for name, value in model_tensors().items())


@FUZZ
@given(
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 7)), min_size=1, max_size=4),
    cut=st.integers(min_value=0, max_value=10_000),
)
def test_corrupt_blobs_with_a_matching_checksum_raise_only_protocol_errors(
    flips: list[tuple[int, int]], cut: int
) -> None:
    # Prepare: recompute the checksum so the safetensors parser itself sees the damage
    manifest, blob = pack_tensors(model_tensors())
    mutated = bytearray(blob)
    for index, bit in flips:
        mutated[index % len(mutated)] ^= 1 << bit
    damaged = bytes(mutated[: cut % (len(mutated) + 1)])
    lying = manifest.model_copy(
        update={"byte_length": len(damaged), "sha256": hashlib.sha256(damaged).hexdigest()}
    )

    # Execute / Assert
    with contextlib.suppress(ProtocolError):
        unpack_tensors(lying, damaged)


def _reformatted(blob: bytes) -> bytes:
    """The same tensors under a header safetensors reads alike but our writer never writes."""
    length = int.from_bytes(blob[:8], "little")
    header = json.dumps(json.loads(blob[8 : 8 + length]), indent=1).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + blob[8 + length :]


def _manifest_of(manifest: TensorManifest, blob: bytes) -> TensorManifest:
    digest = hashlib.sha256(blob).hexdigest()
    return manifest.model_copy(update={"byte_length": len(blob), "sha256": digest})


def test_written_and_reformatted_blobs_unpack_to_the_same_tensors() -> None:
    # Prepare: the writer's layout (cut without a parse) and the same tensors parsed
    tensors = {"a": make_tensor(torch.float32, (3, 4), seed=1), "b": torch.arange(5)}
    manifest, blob = pack_tensors(tensors)
    other = _reformatted(blob)
    layout = {spec.name: (spec.dtype, tuple(spec.shape)) for spec in manifest.tensors}

    # Execute
    written = unpack_tensors(manifest, blob)
    parsed = unpack_tensors(_manifest_of(manifest, other), other)

    # Assert
    assert read_written(blob, layout) is not None
    assert read_written(other, layout) is None
    assert written.keys() == parsed.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(written[name], tensor)
        assert torch.equal(parsed[name], tensor)
    written["a"].add_(1.0)  # writable, and its neighbour is untouched
    assert torch.equal(written["b"], tensors["b"])


def test_a_non_finite_tensor_is_refused_alike_with_or_without_a_parse() -> None:
    # Prepare: "b" poisoned in the writer's layout, and the same bytes under another header
    poisoned = torch.ones(3, 2)
    poisoned[2, 1] = float("nan")
    manifest, blob = crafted_manifest({"a": torch.ones(4), "b": poisoned, "c": torch.ones(5)})
    other = _reformatted(blob)
    layout = {spec.name: (spec.dtype, tuple(spec.shape)) for spec in manifest.tensors}
    assert read_written(other, layout) is None

    # Execute / Assert
    with pytest.raises(ProtocolError, match="'b' contains NaN or Inf"):
        read_written(blob, layout)
    with pytest.raises(ProtocolError, match="'b' contains NaN or Inf"):
        unpack_tensors(manifest, blob)
    with pytest.raises(ProtocolError, match="'b' contains NaN or Inf"):
        unpack_tensors(_manifest_of(manifest, other), other)


def test_a_misaligned_layout_is_parsed_not_cut() -> None:
    # Prepare: a float32 tensor after 3 bytes of int8 starts off its item size
    tensors = {"a": torch.ones(3, dtype=torch.int8), "b": make_tensor(torch.float32, (2,), 0)}
    manifest, blob = pack_tensors(tensors)
    layout = {spec.name: (spec.dtype, tuple(spec.shape)) for spec in manifest.tensors}

    # Execute
    unpacked = unpack_tensors(manifest, blob)

    # Assert
    assert read_written(blob, layout) is None
    assert torch.equal(unpacked["b"], tensors["b"])
