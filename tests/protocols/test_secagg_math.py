"""Secure aggregation's math: Shamir sharing, fixed point, masks, sealing, the neighbour ring."""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from protocols import secure_aggregation as sa

CONTEXT = sa.round_context("ab" * 16, 3)


def test_any_threshold_of_the_shares_rebuild_the_secret_and_fewer_do_not() -> None:
    secret = secrets.token_bytes(32)
    points = list(range(1, 11))
    shares = sa.split_secret(secret, points, threshold=6)
    rng = np.random.default_rng(0)
    for _ in range(5):
        chosen = rng.choice(points, size=6, replace=False)
        assert sa.combine_shares({int(x): shares[int(x)] for x in chosen}) == secret
    five = {x: shares[x] for x in points[:5]}
    with pytest.raises(ValueError, match="different polynomials"):
        assert sa.combine_shares(five) != secret  # wrong, or not even a 32-byte value


def test_shares_of_two_dealings_do_not_combine_into_either_secret() -> None:
    first, second = secrets.token_bytes(32), secrets.token_bytes(32)
    a = sa.split_secret(first, [1, 2, 3], threshold=3)
    b = sa.split_secret(second, [1, 2, 3], threshold=3)
    mixed = {1: a[1], 2: a[2], 3: b[3]}
    try:
        rebuilt = sa.combine_shares(mixed)
    except ValueError:
        return
    assert rebuilt not in (first, second)


def test_fixed_point_sums_of_a_full_cohort_at_the_bound_do_not_overflow() -> None:
    cohort, bound = 500, 3.5
    layout = sa.Layout((("delta", 4, bound),), cohort)
    high = np.full(4, bound)
    total = np.zeros(4, dtype=np.uint32)
    for _ in range(cohort):
        total += sa.encode(high, layout)
    assert np.allclose(
        sa.decode(total, layout), cohort * bound, rtol=0, atol=cohort / 2 / layout.scales()[0]
    )
    total = np.zeros(4, dtype=np.uint32)
    for _ in range(cohort):
        total += sa.encode(-high * 10, layout)  # clamped to -bound first
    assert np.allclose(sa.decode(total, layout), -cohort * bound, atol=1e-3)


def test_decoding_the_sum_of_encodings_is_the_sum_within_the_documented_error() -> None:
    rng = np.random.default_rng(1)
    cohort = 50
    layout = sa.Layout((("delta", 1000, 1.0), ("weight", 1, 200.0)), cohort)
    values = [np.append(rng.uniform(-1, 1, 1000), rng.integers(1, 200)) for _ in range(cohort)]
    total = np.zeros(layout.length, dtype=np.uint32)
    for value in values:
        total += sa.encode(value, layout)
    error = np.abs(sa.decode(total, layout) - np.sum(values, axis=0))
    assert np.all(error <= cohort / (2 * layout.scales()) + 1e-12)


def test_a_scale_that_cannot_fit_the_cohort_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot be summed"):
        sa.group_scale(1.0, 2**33)


def test_pairwise_masks_cancel_in_the_sum_and_self_masks_come_off_with_their_seeds() -> None:
    roster = [f"d{i}" for i in range(7)]
    graph = sa.neighbours(roster, "seed", k=4)
    keys = {d: sa.new_private_key() for d in roster}
    seeds = {d: secrets.token_bytes(32) for d in roster}
    length = 257
    rng = np.random.default_rng(2)
    inputs = {d: rng.integers(0, 2**32, length, dtype=np.uint64).astype(np.uint32) for d in roster}
    total = np.zeros(length, dtype=np.uint32)
    for device in roster:
        pairs = {
            peer: sa.agree(
                keys[device],
                sa.public_hex(keys[peer]),
                "mask",
                sa.pair_context(CONTEXT, device, peer),
            )
            for peer in graph[device]
        }
        total += inputs[device] + sa.mask_sum(length, seeds[device], pairs, device)
    for device in roster:
        total -= sa.prg(seeds[device], length)
    expected = np.zeros(length, dtype=np.uint32)
    for value in inputs.values():
        expected += value
    assert np.array_equal(total, expected)


def test_both_ends_of_a_pair_agree_on_its_key_and_other_pairs_and_rounds_do_not() -> None:
    a, b, c = sa.new_private_key(), sa.new_private_key(), sa.new_private_key()
    ab = sa.pair_context(CONTEXT, "a", "b")
    assert sa.agree(a, sa.public_hex(b), "mask", ab) == sa.agree(b, sa.public_hex(a), "mask", ab)
    assert sa.agree(a, sa.public_hex(b), "mask", ab) != sa.agree(a, sa.public_hex(c), "mask", ab)
    other_round = sa.pair_context(sa.round_context("ab" * 16, 4), "a", "b")
    assert sa.agree(a, sa.public_hex(b), "mask", ab) != sa.agree(
        a, sa.public_hex(b), "mask", other_round
    )
    assert sa.agree(a, sa.public_hex(b), "mask", ab) != sa.agree(a, sa.public_hex(b), "channel", ab)


def test_a_low_order_public_key_is_refused() -> None:
    with pytest.raises(ValueError, match="low-order"):
        sa.agree(sa.new_private_key(), "00" * 32, "mask", CONTEXT)
    assert "low-order" in sa.public_key_problem("00" * 32)
    assert sa.public_key_problem(sa.public_hex(sa.new_private_key())) == ""


def test_a_sealed_bundle_opens_only_with_its_key_and_associated_data_untouched() -> None:
    key = secrets.token_bytes(32)
    sealed = sa.seal(key, b"shares", b"a->b")
    assert sa.unseal(key, sealed, b"a->b") == b"shares"
    with pytest.raises(ValueError, match="does not decrypt"):
        sa.unseal(key, sealed, b"c->b")
    tampered = bytearray(sealed)
    tampered[-1] ^= 1
    with pytest.raises(ValueError, match="does not decrypt"):
        sa.unseal(key, bytes(tampered), b"a->b")
    with pytest.raises(ValueError, match="does not decrypt"):
        sa.unseal(secrets.token_bytes(32), sealed, b"a->b")


@pytest.mark.parametrize(("n", "k"), [(10, 0), (10, 4), (50, 8), (9, 7), (5, 2)])
def test_neighbours_are_symmetric_and_each_device_has_k_or_everyone(n: int, k: int) -> None:
    roster = [f"dev-{i:03d}" for i in range(n)]
    graph = sa.neighbours(roster, "graph-seed", k)
    for device, near in graph.items():
        assert device not in near
        for peer in near:
            assert device in graph[peer]
        full = k == 0 or 2 * -(-k // 2) >= n - 1
        assert len(near) == (n - 1 if full else 2 * -(-k // 2))


def test_the_ring_order_depends_on_the_seed() -> None:
    roster = [f"dev-{i:03d}" for i in range(30)]
    assert sa.ring_order(roster, "one") != sa.ring_order(roster, "two")
    assert sa.ring_order(roster, "one") == sa.ring_order(list(reversed(roster)), "one")


def test_the_keystream_is_a_function_of_the_seed_only() -> None:
    seed = secrets.token_bytes(32)
    assert np.array_equal(sa.prg(seed, 100), sa.prg(seed, 100))
    assert np.array_equal(sa.prg(seed, 100), sa.prg(seed, 200)[:100])
    assert not np.array_equal(sa.prg(seed, 100), sa.prg(secrets.token_bytes(32), 100))
