"""int8 levels under secure aggregation: the packing, the small ring, the rounding, the DP rule."""

from __future__ import annotations

import numpy as np
import pytest

from protocols import secure_aggregation as sa
from protocols.messages import DevicePrivacy, SecureRound
from protocols.secure_levels import (
    LEVELS,
    int8_levels,
    level_bits,
    levels_problem,
    pack_levels,
    packed_size,
    unpack_levels,
)


def _secure(cohort: int, **options: object) -> SecureRound:
    return SecureRound(
        threshold=0.6,
        cohort=cohort,
        min_survivors=3,
        clip_norm=1.0,
        value_bound=1.0,
        int8=True,
        **options,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("cohort", [1, 3, 10, 12, 258, 1000, 100_000])
def test_level_bits_is_the_smallest_signed_ring_holding_every_sum(cohort: int) -> None:
    bits = level_bits(cohort)
    assert LEVELS * cohort <= 2 ** (bits - 1) - 1  # -127 m .. 127 m fit
    assert LEVELS * cohort > 2 ** (bits - 2) - 1  # one bit fewer would not


@pytest.mark.parametrize("bits", [2, 9, 12, 17, 31])
def test_packing_keeps_the_low_bits_of_every_word(bits: int) -> None:
    rng = np.random.default_rng(bits)
    words = rng.integers(0, 2**32, size=1001, dtype=np.uint64).astype(np.uint32)
    packed = pack_levels(words, bits)
    assert packed.dtype == np.uint8
    assert packed.size == packed_size(words.size, bits) == (1001 * bits + 7) // 8
    assert np.array_equal(unpack_levels(packed, words.size, bits), words % (1 << bits))


def test_unpacking_refuses_a_wrong_size_or_set_padding_bits() -> None:
    packed = pack_levels(np.arange(5, dtype=np.uint32), 10)  # 50 bits in 7 bytes
    with pytest.raises(ValueError, match="expected"):
        unpack_levels(packed[:-1], 5, 10)
    padded = packed.copy()
    padded[-1] |= 0x80
    with pytest.raises(ValueError, match="padding"):
        unpack_levels(padded, 5, 10)


def test_masked_levels_modulo_the_small_ring_unmask_to_the_exact_sum() -> None:
    # Prepare: 12 devices, each its levels plus its self mask and the pairwise masks
    cohort, size = 12, 300
    secure = _secure(cohort)
    layout = sa.secure_layout(secure, size, dp_bit=False)
    rng = np.random.default_rng(0)
    devices = [f"d{i:02d}" for i in range(cohort)]
    pair = {(a, b): rng.bytes(32) for a in devices for b in devices if a < b}
    seeds = {d: rng.bytes(32) for d in devices}
    levels = rng.integers(-LEVELS, LEVELS + 1, size=(cohort, size))
    levels[:, 0] = LEVELS  # the extreme sums, both signs
    levels[:, 1] = -LEVELS
    total = np.zeros(layout.length, dtype=np.uint32)
    for index, device in enumerate(devices):
        encoded = sa.encode(np.concatenate([np.zeros(size), [1.0]]), layout)
        encoded[:size] = levels[index].astype(np.uint32)
        peers = {v: pair[min(device, v), max(device, v)] for v in devices if v != device}
        masked = encoded + sa.mask_sum(layout.length, seeds[device], peers, device)
        # Execute: on the wire and back
        tensors = sa.masked_tensors(masked, layout)
        assert {n: t.numel() for n, t in tensors.items()} == {
            sa.LEVELS_TENSOR: packed_size(size, level_bits(cohort)),
            sa.MASKED_TENSOR: 1,
        }
        total += sa.masked_vector(tensors, layout)
    for device in devices:
        total -= sa.prg(seeds[device], layout.length)
    groups = layout.split(sa.decode(total, layout))
    # Assert: the levels' sum times the one step, and the weights' sum
    step = secure.weight_bound * secure.value_bound / LEVELS
    assert np.allclose(groups["delta"], levels.sum(axis=0) * step, rtol=0, atol=1e-12)
    assert groups["delta"][0] == pytest.approx(cohort * 1.0)
    assert groups["weight"][0] == pytest.approx(cohort)


def test_the_levels_scale_is_the_discrete_gaussians_grid() -> None:
    secure = _secure(10, weight_bound=4)
    assert sa.delta_scale(secure) == pytest.approx(LEVELS / 4.0)
    plain = secure.model_copy(update={"int8": False})
    assert sa.delta_scale(plain) == sa.group_scale(4.0, 10)


def test_stochastic_levels_are_unbiased_and_within_int8() -> None:
    rng = np.random.default_rng(1)
    values = np.array([0.3, -0.7, 0.001, 2.0, -5.0])  # the last two are clamped to +-1
    draws = np.stack([int8_levels(values, 1.0, None, rng) for _ in range(20_000)])
    assert draws.min() >= -LEVELS
    assert draws.max() <= LEVELS
    mean = draws.mean(axis=0) / LEVELS
    expected = np.clip(values, -1, 1)
    # each level's rounding has std at most 1/2: 6 standard errors of 20 000 draws
    assert np.all(np.abs(mean - expected) <= 6 * 0.5 / np.sqrt(20_000) / LEVELS)


def test_under_dp_the_levels_keep_the_clip_norm() -> None:
    rng = np.random.default_rng(2)
    direction = rng.normal(size=2000)
    clipped = direction / np.linalg.norm(direction)  # norm 1 = the clip
    step = 1.0 / LEVELS
    for _ in range(50):
        levels = int8_levels(clipped, 1.0, 1.0, rng)
        assert float(np.linalg.norm(levels)) * step <= 1.0
    # plain stochastic rounding of the same vector passes the clip almost always
    loose = [np.linalg.norm(int8_levels(clipped, 1.0, None, rng)) * step for _ in range(50)]
    assert max(loose) > 1.0


def test_under_dp_levels_too_coarse_for_the_dimension_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot keep DP's clip norm"):
        int8_levels(np.zeros(70_000), 1.0, 1.0, np.random.default_rng(0))


@pytest.mark.parametrize(
    ("privacy", "refused"),
    [
        (None, False),
        (DevicePrivacy(clip_norm=1.0), False),  # coordinator placement: no device noise
        (DevicePrivacy(clip_norm=1.0, noise_std=0.3, discrete=True), False),
        (DevicePrivacy(clip_norm=1.0, noise_std=0.3), True),
    ],
)
def test_only_device_placed_continuous_noise_is_kept_off_levels(
    privacy: DevicePrivacy | None, refused: bool
) -> None:
    assert bool(levels_problem(privacy)) == refused
