"""Secure aggregation's math, the same on devices and the coordinator.

Bonawitz et al. 2017, "Practical Secure Aggregation for Privacy-Preserving Machine Learning",
with SecAgg+'s sparse neighbour graph (Bell et al. 2020) as an option. Each round a device draws
two X25519 key pairs (one to encrypt the seed shares it deals, one to agree on masks) and a
self-mask seed b. It adds to its fixed-point-encoded update the stream PRG(b) and, for every
neighbour v, +PRG(s_uv) if its id sorts before v's and -PRG(s_uv) otherwise, s_uv agreed by
X25519: the pairwise masks cancel in the sum. It Shamir-shares b and its mask key among its
neighbours, so that once the masked inputs are in, the survivors' shares rebuild b of every
survivor (removing its self mask) and the mask key of every device that dropped out after
dealing (removing the pairwise masks its survivors added): the coordinator gets the exact sum of
the survivors, nothing else. Every share is committed to by its dealer (a salted SHA-256 the
coordinator holds), every rebuilt secret is checked against the dealer's public key or seed
commitment: a device that reveals a false share, or deals inconsistent ones, is named.

Fixed point: each value group (the weighted delta, the weight, the weighted loss, ...) has a
bound `b` on any one device's value; values become round(v * scale) in Z_(2^32) with
scale = (2^31 - 1 - m/2) / (m * b) for a cohort of m, so the sum of m encoded values stays
within a signed 32-bit integer: no overflow by construction. The sum's error per coordinate is
at most m / (2 * scale).

int8 uplink (`SecureRound.int8`): the delta group is summed as int8 levels instead, one step
for every device, step = bound / 127 (the bound the round announces: weight_bound *
value_bound), each coordinate rounded stochastically (unbiased) or, under DP, conditionally
(`int8_levels`). The masks are still words of Z_(2^32), but the sum of m levels in [-127, 127]
needs only `level_bits(m)` bits, and 2^bits divides 2^32: a masked level is sent reduced
modulo 2^bits, bit-packed (`pack_levels`), and the masks cancel modulo 2^bits as they do
modulo 2^32. The other groups (weight, loss, ...) stay 32-bit fixed point.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Final, Literal

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from pydantic import BaseModel, ConfigDict, Field

from protocols.messages import SecureRound, TensorSpec
from protocols.secure_levels import (
    LEVELS,
    level_bits,
    pack_levels,
    packed_size,
    signed_levels,
    unpack_levels,
)

PRIME: Final = 2**521 - 1
"""The field Shamir shares live in (a Mersenne prime above every 32-byte secret)."""
SHARE_BYTES: Final = 66
SECRET_BYTES: Final = 32
SALT_BYTES: Final = 16
RING_BITS: Final = 32
LIMIT: Final = 2 ** (RING_BITS - 1) - 1
"""The largest sum a coordinate may reach: the sum is read as a signed 32-bit integer."""
SealedKind = Literal["seed", "key"]
"""The two secrets a device deals: its self-mask seed b, and its mask key pair's private key."""


class SecureAggregationSettings(BaseModel):
    """A run's secure aggregation, from its `--secagg-*` flags."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    threshold: Annotated[float, Field(gt=0.5, le=1)] = 0.6
    """Fraction of a device's neighbours whose shares rebuild its secrets. Above one half, so
    no two disjoint sets of holders can each rebuild one of a device's two secrets; at 0.6 up to
    40% of a device's neighbours may drop out."""
    neighbors: Annotated[int, Field(ge=0, le=10_000)] = 0
    """0: every device masks with every other selected device (SecAgg). k: with k neighbours
    on a random ring (SecAgg+), so cost grows with k, not the cohort."""
    clip_norm: Annotated[float, Field(gt=0, le=1e6)] = 10.0
    """The L2 bound on each shared delta (without DP; under DP, DP's clip norm)."""
    loss_bound: Annotated[float, Field(gt=0, le=1e9)] = 100.0
    """Each device's train loss is clamped to [0, loss_bound] before it is summed."""
    phase_timeout_s: Annotated[float, Field(gt=0, le=86_400)] = 60.0
    """The deadline of each short phase (keys, shares, unmasking); training has the round's."""
    max_weight_share: Annotated[float, Field(gt=0, le=1)] = 0.5
    """No device's sample weight may pass this share of the cohort's declared counts (the same
    water-filling cap as plain rounds; 1: off)."""
    retries: Annotated[int, Field(ge=0, le=10)] = 2
    """Attempts after the first when a round fails before any sum is unmasked."""
    int8: bool = False
    """The run's uplink is int8 (`--compress int8`): deltas are summed as int8 levels."""


@dataclass(frozen=True)
class Layout:
    """What a masked vector holds: value groups in order, each with its length and bound."""

    groups: tuple[tuple[str, int, float], ...]
    cohort: int
    delta_bits: int = RING_BITS
    """Below 32: the delta group is int8 levels summed modulo 2^delta_bits."""

    @property
    def length(self) -> int:
        """Coordinates of the whole vector."""
        return sum(size for _, size, _ in self.groups)

    def scales(self) -> np.ndarray:
        """Each coordinate's fixed-point scale (see the module docstring)."""
        parts = [np.full(size, self.scale(name, bound)) for name, size, bound in self.groups]
        return np.concatenate(parts) if parts else np.zeros(0)

    def scale(self, name: str, bound: float) -> float:
        """A group's scale: int8 levels per unit for the delta under int8, else fixed point."""
        if name == "delta" and self.delta_bits < RING_BITS:
            return LEVELS / bound
        return group_scale(bound, self.cohort)

    def split(self, vector: np.ndarray) -> dict[str, np.ndarray]:
        """The vector's groups by name."""
        out, start = {}, 0
        for name, size, _ in self.groups:
            out[name] = vector[start : start + size]
            start += size
        return out


def group_scale(bound: float, cohort: int) -> float:
    """The scale that keeps a sum of `cohort` values within `bound` each inside 32 bits.

    Raises:
        ValueError: not even a scale of 1/bound fits (a cohort of over 2^31 devices).
    """
    if not (bound > 0 and cohort >= 1):
        msg = f"need a positive bound and cohort, got {bound} and {cohort}"
        raise ValueError(msg)
    scale = (LIMIT - cohort / 2) / (cohort * bound)
    if not scale > 0:
        msg = f"{cohort} devices cannot be summed in {RING_BITS} bits"
        raise ValueError(msg)
    return scale


def encode(values: np.ndarray, layout: Layout) -> np.ndarray:
    """Fixed-point values in Z_(2^32), each group clamped to its bound first."""
    bounds = np.concatenate([np.full(size, bound) for _, size, bound in layout.groups])
    clamped = np.clip(np.nan_to_num(values.astype(np.float64)), -bounds, bounds)
    encoded: np.ndarray = np.rint(clamped * layout.scales()).astype(np.int64).astype(np.uint32)
    return encoded


def decode(total: np.ndarray, layout: Layout) -> np.ndarray:
    """The real-valued sum from the sum of encoded values (read as signed 32-bit).

    Under int8 the delta's sum is read modulo 2^delta_bits, as a signed delta_bits integer.
    """
    signed = total.astype(np.uint32).view(np.int32).astype(np.float64)
    if layout.delta_bits < RING_BITS:
        size = layout.groups[0][1]
        signed[:size] = signed_levels(total[:size], layout.delta_bits)
    values: np.ndarray = signed / layout.scales()
    return values


def prg(seed: bytes, length: int) -> np.ndarray:
    """`length` pseudo-random words of Z_(2^32) from a 32-byte seed (ChaCha20's keystream).

    ChaCha20 rather than AES-CTR: as fast where AES has hardware help, several times faster on
    boards without it (a Raspberry Pi 4's Cortex-A72).
    """
    stream = Cipher(algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor()
    return np.frombuffer(stream.update(bytes(4 * length)), dtype=np.uint32)


# -- keys, agreement, sealed shares -------------------------------------------------------


def new_private_key() -> X25519PrivateKey:
    """A fresh X25519 key for one round."""
    return X25519PrivateKey.generate()


def public_hex(key: X25519PrivateKey) -> str:
    """The public half as the 64 hex digits messages carry."""
    return key.public_key().public_bytes_raw().hex()


def private_bytes(key: X25519PrivateKey) -> bytes:
    """The 32 raw bytes of a private key (what a device deals shares of)."""
    return key.private_bytes_raw()


def agree(private: X25519PrivateKey, peer_public_hex: str, purpose: str, context: bytes) -> bytes:
    """A 32-byte key two devices both derive, bound to `purpose` and the round's `context`.

    Raises:
        ValueError: a malformed public key, or a low-order point (an all-zero shared secret).
    """
    peer = X25519PublicKey.from_public_bytes(bytes.fromhex(peer_public_hex))
    try:
        shared = private.exchange(peer)
    except ValueError:
        msg = "a public key that gives no shared secret (a low-order point)"
        raise ValueError(msg) from None
    info = b"pfl-secagg " + purpose.encode() + b"|" + context
    return HKDF(algorithm=SHA256(), length=32, salt=None, info=info).derive(shared)


def public_key_problem(public_hex: str) -> str:
    """Why a device's advertised public key is unusable ("" when it is fine)."""
    try:
        agree(new_private_key(), public_hex, "check", b"")
    except ValueError as error:
        return str(error)
    return ""


def pair_context(round_context: bytes, a: str, b: str) -> bytes:
    """The context of what devices `a` and `b` share, the same from both ends."""
    first, second = sorted((a, b))
    return round_context + b"|" + first.encode() + b"|" + second.encode()


def round_context(run_id: str, round_id: int) -> bytes:
    """What binds keys, shares and masks to one round of one run (no replay across rounds)."""
    return f"{run_id}|{round_id}".encode()


def seed_commitment(context: bytes, device_id: str, seed: bytes) -> str:
    """The hash a device publishes of its self-mask seed, to check the rebuilt one against."""
    return hashlib.sha256(
        b"pfl-secagg seed|" + context + b"|" + device_id.encode() + seed
    ).hexdigest()


def share_commitment(
    context: bytes, dealer: str, holder: str, kind: SealedKind, share: bytes, salt: bytes
) -> str:
    """The hash a dealer publishes of one share it deals (salted: it reveals nothing)."""
    head = f"pfl-secagg share|{dealer}|{holder}|{kind}|".encode()
    return hashlib.sha256(head + context + b"|" + share + salt).hexdigest()


def seal(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """Encrypt-and-authenticate a share bundle for one holder: nonce then ciphertext."""
    nonce = secrets.token_bytes(12)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, associated)


def unseal(key: bytes, sealed: bytes, associated: bytes) -> bytes:
    """The plaintext of `seal`'s output.

    Raises:
        ValueError: too short, or not sealed with this key and these associated bytes.
    """
    if len(sealed) < 12 + 16:
        msg = "a sealed share is too short"
        raise ValueError(msg)
    try:
        return ChaCha20Poly1305(key).decrypt(sealed[:12], sealed[12:], associated)
    except Exception:  # cryptography's InvalidTag: any tampering or a wrong key
        msg = "a sealed share does not decrypt: tampered with, or not meant for this device"
        raise ValueError(msg) from None


# -- Shamir over GF(2^521 - 1) --------------------------------------------------------------


def split_secret(secret: bytes, holders: Sequence[int], threshold: int) -> dict[int, bytes]:
    """Shamir shares of `secret` at the nonzero points `holders`; any `threshold` rebuild it."""
    if not 1 <= threshold <= len(holders):
        msg = f"threshold {threshold} must be within 1..{len(holders)} holders"
        raise ValueError(msg)
    coefficients = [int.from_bytes(secret, "big")] + [
        secrets.randbelow(PRIME) for _ in range(threshold - 1)
    ]
    shares = {}
    for x in holders:
        y = 0
        for coefficient in reversed(coefficients):
            y = (y * x + coefficient) % PRIME
        shares[x] = y.to_bytes(SHARE_BYTES, "big")
    return shares


def combine_shares(shares: Mapping[int, bytes]) -> bytes:
    """The secret the polynomial through `shares` hides (its value at 0), as 32 bytes.

    Raises:
        ValueError: a share outside the field, or a result that is no 32-byte secret (the
            shares do not come from one dealing of that size).
    """
    points = tuple(sorted(shares))
    weights = _lagrange_at_zero(points)
    total = 0
    for x, weight in zip(points, weights, strict=True):
        y = int.from_bytes(shares[x], "big")
        if y >= PRIME:
            msg = "a share lies outside the field"
            raise ValueError(msg)
        total = (total + y * weight) % PRIME
    if total >= 2 ** (8 * SECRET_BYTES):
        msg = "the shares do not rebuild a secret: they come from different polynomials"
        raise ValueError(msg)
    return total.to_bytes(SECRET_BYTES, "big")


@lru_cache(maxsize=256)
def _lagrange_at_zero(points: tuple[int, ...]) -> tuple[int, ...]:
    """Each point's Lagrange weight at 0 (shared by every secret rebuilt from those holders)."""
    weights = []
    for i in points:
        numerator, denominator = 1, 1
        for j in points:
            if j != i:
                numerator = numerator * (-j) % PRIME
                denominator = denominator * (i - j) % PRIME
        weights.append(numerator * pow(denominator, -1, PRIME) % PRIME)
    return tuple(weights)


# -- who masks with whom ------------------------------------------------------------------


def ring_order(roster: Sequence[str], graph_seed: str) -> list[str]:
    """The roster on a ring in an order neither side picks alone (hash of seed and id)."""
    return sorted(roster, key=lambda d: hashlib.sha256(f"{graph_seed}|{d}".encode()).digest())


def neighbours(roster: Sequence[str], graph_seed: str, k: int) -> dict[str, tuple[str, ...]]:
    """Each device's neighbours: everyone else (k = 0 or k >= n - 1), else a Harary ring.

    On the ring, a device neighbours the ceil(k/2) devices on each side (k rounded up to even),
    so the relation is symmetric, as pairwise masks need.
    """
    n = len(roster)
    if k == 0 or k >= n - 1:
        return {d: tuple(sorted(set(roster) - {d})) for d in roster}
    ring = ring_order(roster, graph_seed)
    half = math.ceil(k / 2)
    out = {}
    for index, device in enumerate(ring):
        near = {ring[(index + step) % n] for step in range(-half, half + 1) if step}
        out[device] = tuple(sorted(near))
    return out


def holder_points(roster: Sequence[str]) -> dict[str, int]:
    """Each device's Shamir evaluation point: its 1-based position in the sorted roster."""
    return {device: index + 1 for index, device in enumerate(sorted(roster))}


def threshold_of(neighbour_count: int, fraction: float) -> int:
    """Shares needed to rebuild a secret dealt to `neighbour_count` holders."""
    return max(1, math.ceil(fraction * neighbour_count))


def mask_sum(
    length: int,
    own_seed: bytes,
    pair_seeds: Mapping[str, bytes],
    device_id: str,
) -> np.ndarray:
    """PRG(b) + sum_v sign(u, v) PRG(s_uv) in Z_(2^32): what a device adds to its input."""
    total: np.ndarray = prg(own_seed, length).copy()
    for peer, seed in pair_seeds.items():
        stream = prg(seed, length)
        if device_id < peer:
            total += stream
        else:
            total -= stream
    return total


def constant_time_equal(a: str, b: str) -> bool:
    """Compare two hex digests without leaking where they differ."""
    return hmac.compare_digest(a.encode(), b.encode())


MASKED_TENSOR = "secagg.masked"
"""The one tensor a masked update carries: the vector in Z_(2^32), as int32 (under int8, the
groups after the delta only)."""
LEVELS_TENSOR = "secagg.levels"
"""Under int8: the masked delta levels modulo 2^level_bits, bit-packed (uint8)."""


def secure_layout(secure: SecureRound, delta_length: int, *, dp_bit: bool) -> Layout:
    """The groups every device sums, in order (both sides build it from the announcement)."""
    groups: list[tuple[str, int, float]] = [
        ("delta", delta_length, secure.weight_bound * secure.value_bound),
        ("weight", 1, float(secure.weight_bound)),
    ]
    if secure.loss_bound > 0:
        groups += [("loss", 1, secure.weight_bound * secure.loss_bound), ("clipped", 1, 1.0)]
    if dp_bit:
        groups.append(("within", 1, secure.bit_bound))
    bits = level_bits(secure.cohort) if secure.int8 else RING_BITS
    return Layout(tuple(groups), secure.cohort, bits)


def delta_scale(secure: SecureRound) -> float:
    """The scale of the delta group: the ring's grid a discrete Gaussian lives on.

    Under int8 that is the levels' grid, 127 / bound: the discrete accountant then counts the
    conditional rounding on the coarse grid the sum really holds.
    """
    bound = secure.weight_bound * secure.value_bound
    return LEVELS / bound if secure.int8 else group_scale(bound, secure.cohort)


def masked_specs(layout: Layout) -> list[TensorSpec]:
    """The tensors a masked update of `layout` carries (see MASKED_TENSOR, LEVELS_TENSOR)."""
    if layout.delta_bits >= RING_BITS:
        return [TensorSpec(name=MASKED_TENSOR, dtype="int32", shape=(layout.length,))]
    size = layout.groups[0][1]
    return [
        TensorSpec(
            name=LEVELS_TENSOR, dtype="uint8", shape=(packed_size(size, layout.delta_bits),)
        ),
        TensorSpec(name=MASKED_TENSOR, dtype="int32", shape=(layout.length - size,)),
    ]


def masked_tensors(masked: np.ndarray, layout: Layout) -> dict[str, torch.Tensor]:
    """A masked vector in Z_(2^32) as the tensors an update carries."""
    if layout.delta_bits >= RING_BITS:
        return {MASKED_TENSOR: torch.from_numpy(masked.view(np.int32).copy())}
    size = layout.groups[0][1]
    return {
        LEVELS_TENSOR: torch.from_numpy(pack_levels(masked[:size], layout.delta_bits)),
        MASKED_TENSOR: torch.from_numpy(masked[size:].view(np.int32).copy()),
    }


def masked_vector(tensors: Mapping[str, torch.Tensor], layout: Layout) -> np.ndarray:
    """`masked_tensors` undone: the vector in Z_(2^32), levels as their residues mod 2^bits.

    Raises:
        ValueError: packed levels that are not `layout`'s.
    """
    rest: np.ndarray = tensors[MASKED_TENSOR].numpy().view(np.uint32).copy()
    if layout.delta_bits >= RING_BITS:
        return rest
    size = layout.groups[0][1]
    levels = unpack_levels(tensors[LEVELS_TENSOR].numpy(), size, layout.delta_bits)
    return np.concatenate([levels, rest]).astype(np.uint32)
