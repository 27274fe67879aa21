"""Unmasking: rebuild the secrets from revealed shares, remove the masks, check the sum.

Every rebuilt secret is checked against the dealer's public key or seed commitment (a dealer
whose shares rebuild another one is named), and the sum against what honest devices can send
(masking hides which device sent an out-of-range update, so that refuses the round).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from coordinator.stages.secure.bounds import NOISE_ROOM
from coordinator.stages.secure.state import Reveals, RoundState
from coordinator.strategies.base import ReceivedUpdate
from protocols import secure_aggregation as sa
from protocols.codec import Tensors
from protocols.errors import RoundError
from protocols.secure_levels import LEVELS


@dataclass(frozen=True)
class SecureSum:
    """What unmasking reveals: sums over the survivors, nothing per device."""

    survivors: tuple[str, ...]
    dropped: tuple[str, ...]
    total: Tensors
    """The sum of the survivors' weighted, clipped deltas."""
    weight: float
    loss: float | None
    """The weighted mean train loss (None under DP)."""
    clipped: int | None
    within: float | None
    """Under DP's adaptive clipping: the sum of the survivors' noised within-clip bits."""

    def scalars(self) -> dict[str, float]:
        """The round record's view: survivors, dropouts, and (without DP) how many clipped."""
        out = {
            "secagg_survivors": float(len(self.survivors)),
            "secagg_dropped": float(len(self.dropped)),
        }
        if self.clipped is not None:
            out["secagg_clipped"] = float(self.clipped)
        return out

    def as_update(self, *, mean: bool) -> ReceivedUpdate:
        """One update standing for all survivors: their weighted mean (or, for DP, the sum)."""
        scale = 1 / self.weight if mean and self.weight > 0 else 1.0
        delta = {name: tensor * scale for name, tensor in self.total.items()}
        loss = self.loss if self.loss is not None else 0.0
        return ReceivedUpdate("secure-sum", max(1, round(self.weight)), loss, delta)


def rebuild(
    state: RoundState,
    dealer: str,
    kind: sa.SealedKind,
    reveals: list[Reveals],
    blame: Callable[[str, str], None],
) -> bytes | None:
    """The dealer's secret; None (the dealer blamed) when its shares rebuild another one.

    Raises:
        RoundError: fewer shares came back than the secret's threshold.
    """
    shares = dict(r[(dealer, kind)] for r in reveals if (dealer, kind) in r)
    needed = state.threshold(dealer)
    if len(shares) < needed:
        msg = (
            f"secure aggregation: {len(shares)} of the {needed} shares needed to rebuild "
            f"{dealer}'s {'seed' if kind == 'seed' else 'mask key'} came back"
        )
        raise RoundError(msg, round_id=state.round_id)
    chosen = dict(sorted(shares.items())[:needed])
    try:
        secret = sa.combine_shares(chosen)
        if kind == "seed":
            good = sa.constant_time_equal(
                sa.seed_commitment(state.context, dealer, secret),
                state.keys[dealer].seed_commitment,
            )
        else:
            rebuilt = sa.public_hex(X25519PrivateKey.from_private_bytes(secret))
            good = rebuilt == state.keys[dealer].mask_key
    except ValueError:
        good = False
    if not good:
        reason = f"dealt shares that do not rebuild the {kind} it committed to"
        blame(dealer, reason)
        state.culprits.add(dealer)
        return None
    return secret


def remove_masks(
    state: RoundState,
    masked: dict[str, np.ndarray],
    seeds: dict[str, bytes],
    mask_keys: dict[str, bytes],
) -> np.ndarray:
    """Sum of the masked inputs minus the survivors' self masks and the dropped pairs' masks."""
    length = state.layout().length
    total = np.zeros(length, dtype=np.uint32)
    for survivor in state.survivors:
        total += masked[survivor]
        total -= sa.prg(seeds[survivor], length)
    for gone, raw in mask_keys.items():
        private = X25519PrivateKey.from_private_bytes(raw)
        for survivor in state.neighbours[gone]:
            if survivor not in masked:
                continue
            pair = sa.pair_context(state.context, survivor, gone)
            stream = sa.prg(sa.agree(private, state.keys[survivor].mask_key, "mask", pair), length)
            if survivor < gone:  # the survivor added +PRG(s_uv) and its partner never sent
                total -= stream
            else:
                total += stream
    return total


def decoded(state: RoundState, total: np.ndarray, dropped: tuple[str, ...]) -> SecureSum:
    """The real-valued sums, checked against what honest survivors can send.

    Raises:
        RoundError: a sum out of that range (a device sent an out-of-range masked vector).
    """
    secure, layout = state.secure, state.layout()
    groups = layout.split(sa.decode(total, layout))
    count = len(state.survivors)
    weight = float(groups["weight"][0])
    delta = groups["delta"]
    problems = []
    if not count - 0.5 <= weight <= count * secure.weight_bound + 0.5:
        problems.append(f"a total weight of {weight:.6g} from {count} devices")
    coordinate_bound = count * secure.weight_bound * secure.value_bound * (1 + 1e-9)
    if delta.size and float(np.abs(delta).max()) > coordinate_bound:
        problems.append(
            f"an entry of {float(np.abs(delta).max()):.6g} (bound {coordinate_bound:.6g})"
        )
    norm, noise = float(np.linalg.norm(delta)), (secure.value_bound - secure.clip_norm) / NOISE_ROOM
    norm_bound = weight * secure.clip_norm + noise * count**0.5 * (delta.size**0.5 + NOISE_ROOM)
    if secure.int8:  # each device's stochastic rounding moves each entry by under one level
        step = secure.weight_bound * secure.value_bound / LEVELS
        norm_bound += count * step * delta.size**0.5
    if norm > norm_bound * (1 + 1e-6) + 1e-6:
        problems.append(
            f"a norm of {norm:.6g} over the clipped (and noised) bound {norm_bound:.6g}"
        )
    if problems:
        state.unmasked = count
        msg = (
            f"secure aggregation: the unmasked sum holds {'; '.join(problems)}: no {count} honest "
            "devices send that, so one lied (masking hides which); the round is not applied"
        )
        raise RoundError(msg, round_id=state.round_id)
    tensors, start = {}, 0
    for spec in sorted(state.specs, key=lambda s: s.name):
        size = int(np.prod(spec.shape))
        values = torch.from_numpy(delta[start : start + size].copy()).reshape(spec.shape)
        tensors[spec.name] = values.to(getattr(torch, spec.dtype))
        start += size
    loss = float(groups["loss"][0]) / weight if "loss" in groups and weight > 0 else None
    clipped = round(float(groups["clipped"][0])) if "clipped" in groups else None
    within = float(groups["within"][0]) if "within" in groups else None
    return SecureSum(state.survivors, dropped, tensors, weight, loss, clipped, within)
