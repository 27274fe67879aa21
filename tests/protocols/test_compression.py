"""The update codecs against closed forms: int8 error bounds, exact top-k, error feedback."""

from __future__ import annotations

import math

import pytest
import torch

from protocols.codec import describe_tensors, pack_tensors, unpack_tensors
from protocols.compression import (
    INT8_SCALES,
    TOPK_INDICES,
    TOPK_VALUES,
    apply_model_delta,
    decode,
    encode,
    encode_model_delta,
    encoded_layout,
    int8_dequantize,
    int8_quantize,
    topk_count,
    with_error_feedback,
)
from protocols.errors import ProtocolError
from protocols.messages import Compression

INT8 = Compression(codec="int8")
STOCHASTIC = Compression(codec="int8", rounding="stochastic")


def _delta(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden.weight": torch.randn(16, 8, generator=g),
        "hidden.bias": torch.randn(16, generator=g) * 0.01,
        "steps": torch.tensor([3, 4]),  # not float32: travels as it is
    }


def _round_trip(
    dense: dict[str, torch.Tensor], compression: Compression
) -> dict[str, torch.Tensor]:
    """Through the wire format: pack, unpack against the layout the receiver derives, decode."""
    manifest, blob = pack_tensors(encode(dense, compression, torch.Generator().manual_seed(1)))
    layout = encoded_layout(describe_tensors(dense), compression)
    return decode(
        unpack_tensors(manifest, blob, expected=layout), describe_tensors(dense), compression
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("none", Compression()),
        ("int8", INT8),
        ("INT8:stochastic", STOCHASTIC),
        ("topk:0.01", Compression(codec="topk", fraction=0.01)),
    ],
)
def test_compression_parses_its_text_forms(text: str, expected: Compression) -> None:
    assert Compression.parse(text) == expected
    assert Compression.parse(str(expected)) == expected


@pytest.mark.parametrize("text", ["gzip", "topk", "topk:0", "topk:1.5", "topk:x", "int8:up"])
def test_compression_refuses_other_forms_by_name(text: str) -> None:
    with pytest.raises(ValueError, match="invalid compression"):
        Compression.parse(text)


def test_int8_nearest_error_is_at_most_half_a_scale() -> None:
    dense = _delta()
    out = _round_trip(dense, INT8)
    for name in ("hidden.weight", "hidden.bias"):
        scale = dense[name].abs().max() / 127
        assert (out[name] - dense[name]).abs().max() <= scale / 2 + 1e-7
    assert torch.equal(out["steps"], dense["steps"])


def test_int8_stochastic_rounding_is_unbiased_and_within_a_scale() -> None:
    x = torch.linspace(-1, 1, 101)
    scale = 1 / 127
    draws = torch.stack(
        [
            int8_dequantize(*int8_quantize(x, "stochastic", torch.Generator().manual_seed(s)))
            for s in range(400)
        ]
    )
    assert (draws - x).abs().max() < scale + 1e-7
    # the mean of 400 draws sits within 4 standard errors (at most scale/2 / sqrt(400)) of x
    assert (draws.mean(dim=0) - x).abs().max() < 4 * (scale / 2) / math.sqrt(400)


def test_int8_of_zeros_has_scale_zero() -> None:
    q, scale = int8_quantize(torch.zeros(5))
    assert float(scale) == 0.0
    assert not q.any()


def test_topk_keeps_exactly_the_k_largest_magnitudes() -> None:
    dense = _delta()
    compression = Compression(codec="topk", fraction=0.05)
    out = _round_trip(dense, compression)
    flat_in = torch.cat([dense["hidden.bias"], dense["hidden.weight"].reshape(-1)])  # name order
    flat_out = torch.cat([out["hidden.bias"], out["hidden.weight"].reshape(-1)])
    k = topk_count(flat_in.numel(), 0.05)
    assert k == math.ceil(0.05 * 144)
    largest = set(torch.argsort(flat_in.abs(), descending=True)[:k].tolist())
    kept = set(torch.nonzero(flat_out).reshape(-1).tolist())
    assert kept == largest
    assert torch.equal(flat_out[sorted(kept)], flat_in[sorted(kept)])  # values exact
    assert torch.equal(out["steps"], dense["steps"])


def test_encoded_layouts_are_what_travels() -> None:
    specs = describe_tensors(_delta())
    int8 = {s.name: (s.dtype, s.shape) for s in encoded_layout(specs, INT8)}
    assert int8 == {
        "hidden.bias": ("int8", (16,)),
        "hidden.weight": ("int8", (16, 8)),
        INT8_SCALES: ("float32", (2,)),
        "steps": ("int64", (2,)),
    }
    topk = {
        s.name: s.shape for s in encoded_layout(specs, Compression(codec="topk", fraction=0.01))
    }
    assert topk == {TOPK_INDICES: (2,), TOPK_VALUES: (2,), "steps": (2,)}


def test_bytes_shrink_as_promised_on_a_large_delta() -> None:
    dense = {"w": torch.randn(256, 256)}
    raw = pack_tensors(dense)[1]
    int8 = pack_tensors(encode(dense, INT8))[1]
    top1 = pack_tensors(encode(dense, Compression(codec="topk", fraction=0.01)))[1]
    assert len(int8) <= 0.26 * len(raw)
    assert len(top1) <= 0.03 * len(raw)


@pytest.mark.parametrize(
    ("indices", "reason"),
    [
        ([3, 3], "increase strictly"),
        ([5, 2], "increase strictly"),
        ([-1, 2], "within"),
        ([0, 144], "within"),
    ],
)
def test_decode_refuses_indices_that_are_not_increasing_positions(
    indices: list[int], reason: str
) -> None:
    dense = describe_tensors({"w": torch.zeros(144)})
    encoded = {TOPK_INDICES: torch.tensor(indices, dtype=torch.int32), TOPK_VALUES: torch.ones(2)}
    with pytest.raises(ProtocolError, match=reason):
        decode(encoded, dense, Compression(codec="topk", fraction=0.01))


def test_decode_refuses_negative_scales() -> None:
    dense = describe_tensors({"w": torch.zeros(4)})
    encoded = {"w": torch.ones(4, dtype=torch.int8), INT8_SCALES: torch.tensor([-1.0])}
    with pytest.raises(ProtocolError, match="negative"):
        decode(encoded, dense, INT8)


def test_a_blob_for_a_larger_k_fails_the_layout_check() -> None:
    dense = {"w": torch.randn(1000)}
    too_many = encode(dense, Compression(codec="topk", fraction=0.1))
    manifest, blob = pack_tensors(too_many)
    layout = encoded_layout(describe_tensors(dense), Compression(codec="topk", fraction=0.01))
    with pytest.raises(ProtocolError, match="shape"):
        unpack_tensors(manifest, blob, expected=layout)


@pytest.mark.parametrize(
    "compression", [INT8, STOCHASTIC, Compression(codec="topk", fraction=0.01)]
)
def test_error_feedback_makes_the_sent_sum_track_the_true_sum(compression: Compression) -> None:
    """Sum of sent = sum of true - final residual, exactly; the residual stays bounded."""
    g = torch.Generator().manual_seed(0)
    residual: dict[str, torch.Tensor] = {}
    true_sum = torch.zeros(400)
    sent_sum = torch.zeros(400)
    gaps, residual_norms = [], []
    for _ in range(300):
        delta = {"w": torch.randn(400, generator=g) * 0.1 + 0.05}  # a drift top-k alone would lose
        encoded, residual = with_error_feedback(delta, residual, compression, g)
        sent = decode(encoded, describe_tensors(delta), compression)
        true_sum += delta["w"]
        sent_sum += sent["w"]
        assert torch.allclose(sent_sum + residual["w"], true_sum, atol=1e-3)
        gaps.append(float((sent_sum - true_sum).norm() / true_sum.norm()))
        residual_norms.append(float(residual["w"].norm()))
    # the residual stops growing, so the relative gap shrinks like 1 / rounds
    assert max(residual_norms[150:]) < 1.5 * max(residual_norms[:150])
    assert gaps[-1] < gaps[29] / 3
    # without feedback, top-1% of a drifting delta loses most of it
    if compression.codec == "topk":
        plain = sum(
            (
                decode(
                    encode({"w": torch.full((400,), 0.05)}, compression),
                    describe_tensors({"w": torch.zeros(400)}),
                    compression,
                )["w"]
                for _ in range(10)
            ),
            torch.zeros(400),
        )
        assert float(plain.sum()) < 0.1 * 0.05 * 400 * 10


def test_a_residual_of_another_shape_is_dropped() -> None:
    delta = {"w": torch.ones(4)}
    encoded, residual = with_error_feedback(delta, {"w": torch.ones(3)}, INT8)
    assert torch.allclose(decode(encoded, describe_tensors(delta), INT8)["w"], torch.ones(4))
    assert residual["w"].shape == (4,)


def test_no_compression_keeps_no_residual() -> None:
    encoded, residual = with_error_feedback(
        {"w": torch.ones(4)}, {"w": torch.ones(4)}, Compression()
    )
    assert torch.equal(encoded["w"], torch.ones(4))
    assert residual == {}


def test_a_model_delta_rebuilds_the_same_bits_on_both_ends() -> None:
    base = {"a": torch.randn(30, 4), "personal": torch.randn(5), "count": torch.tensor(3)}
    target = {**base, "a": base["a"] + 0.01 * torch.randn(30, 4)}
    made = encode_model_delta(base, target)
    assert made is not None
    encoded, rebuilt = made
    assert set(encoded) == {"a", INT8_SCALES}  # unchanged tensors do not travel
    scale = float((target["a"] - base["a"]).abs().max() / 127)
    assert float((rebuilt["a"] - target["a"]).abs().max()) <= scale / 2 + 1e-6
    # the receiver decodes what travelled and applies it to its own copy of the base
    manifest, blob = pack_tensors(encoded)
    dense = describe_tensors({"a": base["a"]})
    received = unpack_tensors(manifest, blob, expected=encoded_layout(dense, INT8))
    device = apply_model_delta(
        {k: v.clone() for k, v in base.items()}, decode(received, dense, INT8)
    )
    assert pack_tensors(device)[0].sha256 == pack_tensors(rebuilt)[0].sha256


def test_a_model_delta_needs_the_same_layout() -> None:
    base = {"a": torch.zeros(3)}
    assert encode_model_delta(base, {"a": torch.zeros(4)}) is None
    assert encode_model_delta(base, {"b": torch.zeros(3)}) is None


@pytest.mark.parametrize("scale", [3e38, 2.7e36])
def test_a_finite_int8_frame_that_decodes_to_inf_is_refused(scale: float) -> None:
    # Prepare: every encoded tensor is finite, so the blob passes unpack_tensors' checks
    dense = {"w": torch.zeros(4), "b": torch.zeros(2)}
    encoded = {
        "b": torch.ones(2, dtype=torch.int8),
        "w": torch.tensor([127, -127, 1, 0], dtype=torch.int8),
        INT8_SCALES: torch.tensor([1.0, scale]),  # one per tensor in name order: b, then w
    }
    manifest, blob = pack_tensors(encoded)
    checked = unpack_tensors(manifest, blob, expected=encoded_layout(describe_tensors(dense), INT8))

    # Execute / Assert: 127 * scale overflows float32 to +-Inf
    with pytest.raises(ProtocolError, match="'w' decodes to NaN or Inf"):
        decode(checked, describe_tensors(dense), INT8)
