"""Compressed deltas on the wire: per-tensor int8 with a scale, and top-k sparsification.

Pure functions both sides import. A codec turns dense float32 tensors into a few tensors that travel
in the usual safetensors blob, and back: a device's update under the run's `--compress` (the
announcement's `uplink`, echoed in the update's `compression`), and with `--compress-down int8` the
model as a `ModelDelta` from the one before it. The encoded layout follows from the dense layout and
the codec alone, so a receiver checks an encoded blob exactly as a dense one (`unpack_tensors(...,
expected=encoded_layout(...))`) before `decode` checks what a layout cannot (index order and range,
scales). Only float32 tensors are compressed; others travel as they are.

    int8   <name>: int8, the tensor's shape; `int8:scales`: float32 (n,), one per compressed
           tensor in name order. Value = q * scale, scale = max|x| / 127: error <= scale / 2
           (nearest) or < scale (stochastic, unbiased).
    topk   `topk:indices`: int32 (k,) strictly increasing positions in the concatenation of the
           compressed tensors (name order, flattened); `topk:values`: float32 (k,). One top-k over
           the whole delta, k = ceil(fraction * total elements): the k largest magnitudes, the
           rest zero.

Under secure aggregation an update is one masked vector instead (`secagg.masked`, int32); with
`int8` its delta travels as int8 levels of the step the round announces, masked and reduced
modulo 2^level_bits(cohort), bit-packed in `secagg.levels` (uint8; `protocols.secure_levels`).
top-k is refused there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Final

import torch

from protocols.codec import Tensors, describe_tensors
from protocols.errors import ProtocolError
from protocols.messages import Compression, TensorSpec

INT8_SCALES: Final = "int8:scales"
TOPK_INDICES: Final = "topk:indices"
TOPK_VALUES: Final = "topk:values"
INT8_LEVELS: Final = 127
"""q in [-127, 127]: symmetric, so -x encodes as -q."""


NO_COMPRESSION: Final = Compression()


def compressible(spec: TensorSpec) -> bool:
    """Only float32 tensors are compressed; integer or other float tensors travel as they are."""
    return spec.dtype == "float32"


def topk_count(total: int, fraction: float) -> int:
    """How many entries a top-k of `fraction` keeps out of `total` (at least one, if any)."""
    return 0 if total == 0 else min(total, max(1, math.ceil(fraction * total)))


def encoded_layout(dense: Sequence[TensorSpec], compression: Compression) -> tuple[TensorSpec, ...]:
    """The tensors a delta of layout `dense` travels as, sorted by name like every manifest."""
    if compression.codec == "none":
        return tuple(sorted(dense, key=lambda s: s.name))
    kept = [s for s in dense if not compressible(s)]
    packed = sorted((s for s in dense if compressible(s)), key=lambda s: s.name)
    if compression.codec == "int8":
        extra = [TensorSpec(name=s.name, dtype="int8", shape=s.shape) for s in packed]
        extra.append(TensorSpec(name=INT8_SCALES, dtype="float32", shape=(len(packed),)))
    else:
        k = topk_count(sum(math.prod(s.shape) for s in packed), compression.fraction)
        extra = [
            TensorSpec(name=TOPK_INDICES, dtype="int32", shape=(k,)),
            TensorSpec(name=TOPK_VALUES, dtype="float32", shape=(k,)),
        ]
    return tuple(sorted([*kept, *extra], key=lambda s: s.name))


def encode(
    dense: Mapping[str, torch.Tensor],
    compression: Compression,
    generator: torch.Generator | None = None,
) -> Tensors:
    """The tensors `dense` travels as under `compression` (see the module docstring).

    Raises:
        ProtocolError: a top-k delta has 2**31 entries or more (int32 indices).
    """
    if compression.codec == "none":
        return dict(dense)
    names = sorted(n for n, t in dense.items() if t.dtype == torch.float32)
    out: Tensors = {n: t for n, t in dense.items() if t.dtype != torch.float32}
    if compression.codec == "int8":
        scales = []
        for name in names:
            q, scale = int8_quantize(dense[name], compression.rounding, generator)
            out[name] = q
            scales.append(scale)
        out[INT8_SCALES] = torch.stack(scales) if scales else torch.zeros(0)
        return out
    flat = _flatten(dense, names)
    if flat.numel() >= 2**31:
        msg = f"a top-k delta of {flat.numel()} entries exceeds int32 indices"
        raise ProtocolError(msg)
    indices, values = topk_select(flat, topk_count(flat.numel(), compression.fraction))
    out[TOPK_INDICES] = indices.to(torch.int32)
    out[TOPK_VALUES] = values
    return out


def decode(
    encoded: Mapping[str, torch.Tensor],
    dense: Sequence[TensorSpec],
    compression: Compression,
) -> Tensors:
    """Dense float32 tensors back from `encode`'s output, already checked against the layout.

    The encoded tensors are finite (`unpack_tensors` checks that), but their product need not
    be: an int8 level times a scale near float32's maximum is Inf. So the dense result is
    checked again, and nothing downstream (strategy, guard, DP clipping) ever sees NaN or Inf.

    Raises:
        ProtocolError: a scale is negative, top-k indices are not strictly increasing
            positions inside the delta (a repeated index would count an entry twice), or a
            decoded tensor holds NaN or Inf.
    """
    if compression.codec == "none":
        return dict(encoded)
    return _require_finite(_decode_lossy(encoded, dense, compression))


def _decode_lossy(
    encoded: Mapping[str, torch.Tensor],
    dense: Sequence[TensorSpec],
    compression: Compression,
) -> Tensors:
    packed = sorted((s for s in dense if compressible(s)), key=lambda s: s.name)
    out: Tensors = {s.name: encoded[s.name] for s in dense if not compressible(s)}
    if compression.codec == "int8":
        scales = encoded[INT8_SCALES]
        if bool((scales < 0).any()):
            msg = "int8 scales must not be negative"
            raise ProtocolError(msg)
        for spec, scale in zip(packed, scales, strict=True):
            out[spec.name] = int8_dequantize(encoded[spec.name], scale)
        return out
    total = sum(math.prod(s.shape) for s in packed)
    indices = encoded[TOPK_INDICES].to(torch.int64)
    if indices.numel() and (
        int(indices[0]) < 0
        or int(indices[-1]) >= total
        or not bool((indices[1:] > indices[:-1]).all())
    ):
        msg = f"top-k indices must increase strictly within [0, {total})"
        raise ProtocolError(msg)
    flat = torch.zeros(total, dtype=torch.float32)
    flat[indices] = encoded[TOPK_VALUES]
    offset = 0
    for spec in packed:
        size = math.prod(spec.shape)
        out[spec.name] = flat[offset : offset + size].reshape(spec.shape)
        offset += size
    return out


def _require_finite(decoded: Tensors) -> Tensors:
    for name, value in decoded.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            msg = f"tensor {name!r} decodes to NaN or Inf"
            raise ProtocolError(msg)
    return decoded


def int8_quantize(
    x: torch.Tensor, rounding: str = "nearest", generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) with q int8 in [-127, 127] and x ~ q * scale; scale = max|x| / 127 (float32)."""
    x = x.detach().to(torch.float32)
    peak = x.abs().max() if x.numel() else torch.tensor(0.0)
    scale = (peak / INT8_LEVELS).to(torch.float32).reshape(())
    if float(scale) == 0.0 or not math.isfinite(float(scale)):
        return torch.zeros_like(x, dtype=torch.int8), torch.zeros((), dtype=torch.float32)
    levels = x / scale
    if rounding == "stochastic":
        noise = torch.rand(levels.shape, generator=generator, dtype=torch.float32)
        levels = torch.floor(levels + noise)
    else:
        levels = torch.round(levels)
    q = levels.clamp(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
    return q, scale


def int8_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The value of an int8 level: the one formula both ends use, so both get the same bits."""
    return q.to(torch.float32) * scale.to(torch.float32)


def topk_select(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions (increasing) and values of the `k` largest magnitudes of a 1-D tensor."""
    if k == 0:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float32)
    positions = torch.topk(flat.abs(), k, sorted=False).indices
    positions = torch.sort(positions).values
    return positions, flat[positions].to(torch.float32)


def _flatten(dense: Mapping[str, torch.Tensor], names: Sequence[str]) -> torch.Tensor:
    if not names:
        return torch.zeros(0, dtype=torch.float32)
    return torch.cat([dense[n].detach().reshape(-1).to(torch.float32) for n in names])


def with_error_feedback(
    delta: Mapping[str, torch.Tensor],
    residual: Mapping[str, torch.Tensor],
    compression: Compression,
    generator: torch.Generator | None = None,
) -> tuple[Tensors, Tensors]:
    """(encoded, new residual): compress delta + residual, keep what did not make it.

    The residual carries the compression error into the next round, so the sum of what is sent
    tracks the sum of the true deltas (error feedback). A residual that does not fit the delta's
    names and shapes (a new stage, another model) is dropped. Without loss there is no residual.
    """
    if not compression.lossy:
        return dict(delta), {}
    fits = all(
        name in residual and residual[name].shape == value.shape
        for name, value in delta.items()
        if value.dtype == torch.float32
    )
    corrected = {
        name: value + residual[name] if fits and value.dtype == torch.float32 else value
        for name, value in delta.items()
    }
    encoded = encode(corrected, compression, generator)
    sent = decode(encoded, describe_tensors(delta), compression)
    new_residual = {
        name: (value - sent[name]).detach()
        for name, value in corrected.items()
        if value.dtype == torch.float32
    }
    return encoded, new_residual


CLIP_MARGIN: Final = 1e-6
"""A re-clip aims this much below the norm: float32 rounding must not carry it over."""


def clip_encoded(
    encoded: Mapping[str, torch.Tensor],
    dense: Sequence[TensorSpec],
    compression: Compression,
    max_norm: float,
) -> Tensors:
    """`encode`'s output scaled so that what it decodes to has an L2 norm of at most `max_norm`.

    Under DP the bound must hold on what is sent: with error feedback a codec sends the clipped
    delta plus earlier rounds' residual, which may be longer. `decode` is linear in the floating
    tensors an encoding carries (int8 scales, top-k values, tensors sent as they are), so
    scaling those scales the decoded delta; integer tensors (levels, indices) stay.
    """
    sent = decode(encoded, dense, compression)
    squares = sum(float(t.double().square().sum()) for t in sent.values() if t.is_floating_point())
    norm = math.sqrt(squares)
    if norm <= max_norm:
        return dict(encoded)
    scale = max_norm / norm * (1 - CLIP_MARGIN)
    return {
        name: (t.double() * scale).to(t.dtype) if t.is_floating_point() else t
        for name, t in encoded.items()
    }


# -- model deltas (compressed downlink) ------------------------------------------------------

INT8: Final = Compression(codec="int8")


def encode_model_delta(
    base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]
) -> tuple[Tensors, Tensors] | None:
    """(encoded delta, the model a device holding `base` rebuilds from it), or None.

    Only tensors that changed travel, as int8 with a scale. The rebuilt model is what every
    device will hold, so the sender adopts it as the model it publishes: whoever downloads the
    whole model and whoever applies the delta then hold the same bits. None when the two models
    differ in names, shapes or dtypes, or a changed tensor is not float32: send it whole.
    """
    if base.keys() != target.keys() or any(
        base[n].shape != target[n].shape or base[n].dtype != target[n].dtype for n in target
    ):
        return None
    changed = {
        n: target[n] - base[n] for n in sorted(target) if not torch.equal(base[n], target[n])
    }
    if any(value.dtype != torch.float32 for value in changed.values()):
        return None
    encoded = encode(changed, INT8)
    rebuilt = apply_model_delta(base, decode(encoded, describe_tensors(changed), INT8))
    return encoded, rebuilt


def model_delta_layout(
    delta: Sequence[TensorSpec], base: Sequence[TensorSpec]
) -> tuple[TensorSpec, ...]:
    """The dense layout a model delta's manifest claims, checked against the base model.

    Raises:
        ProtocolError: the delta names a tensor the base lacks, or one that is not float32.
    """
    held = {spec.name: spec for spec in base}
    dense = []
    for spec in delta:
        if spec.name == INT8_SCALES:
            continue
        known = held.get(spec.name)
        if known is None or not compressible(known):
            msg = f"the model delta names {spec.name!r}, not a float32 tensor of the held model"
            raise ProtocolError(msg)
        dense.append(known)
    return tuple(dense)


def apply_model_delta(
    base: Mapping[str, torch.Tensor], deltas: Mapping[str, torch.Tensor]
) -> Tensors:
    """The base plus the deltas of the tensors `deltas` names (one formula, both ends)."""
    return {name: value + deltas[name] if name in deltas else value for name, value in base.items()}
