"""A device's side of secure aggregation: fresh keys, dealt shares, a masked update, reveals.

Per round (protocols.secure_aggregation): on the announcement it draws keys and publishes them;
on the roster it deals its seed's and mask key's shares to its neighbours; on its inbox it may
train, and masks its update with the dealers' pairwise seeds; on the unmasking it reveals, for
each dealer, the one share the coordinator may have: the seed's of a survivor, the mask key's of
a device that dropped out, and never both for one dealer, even when asked twice.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from device_agent.algorithms.base import LocalResult
from device_agent.replies import update_message, work_key
from protocols import secure_aggregation as sa
from protocols.codec import Tensors
from protocols.discrete_gaussian import noised_ring_values
from protocols.errors import ProtocolError
from protocols.messages import (
    DeviceUpdate,
    Message,
    RevealedShare,
    RosterEntry,
    RoundAnnouncement,
    SealedShares,
    SecAggInbox,
    SecAggKeys,
    SecAggReveal,
    SecAggRoster,
    SecAggShares,
    SecAggUnmask,
    SecureRound,
)
from protocols.secure_aggregation import secure_layout
from protocols.secure_levels import int8_levels, levels_problem

logger = logging.getLogger(__name__)


@dataclass
class _Round:
    """One round's secrets and what arrived for it; dropped when the next round starts."""

    run_id: str
    round_id: int
    secure: SecureRound
    channel: X25519PrivateKey = field(default_factory=sa.new_private_key)
    mask: X25519PrivateKey = field(default_factory=sa.new_private_key)
    seed: bytes = field(default_factory=lambda: secrets.token_bytes(sa.SECRET_BYTES))
    roster: dict[str, RosterEntry] = field(default_factory=dict)
    neighbours: tuple[str, ...] = ()
    held: dict[str, bytes] = field(default_factory=dict)
    """The share bundle each dealer sealed for this device (seed share, salt, key share, salt)."""
    dealers: tuple[str, ...] | None = None
    revealed_for: tuple[str, ...] | None = None

    @property
    def context(self) -> bytes:
        return sa.round_context(self.run_id, self.round_id)

    def matches(self, message: Message) -> bool:
        return (
            getattr(message, "run_id", None) == self.run_id
            and getattr(message, "round_id", None) == self.round_id
        )


class SecureClient:
    """Secure aggregation for one device; `publish` sends a frame on its `secagg` topic."""

    def __init__(
        self,
        device_id: str,
        publish: Callable[[Message], object],
        ring_noise: Callable[[RoundAnnouncement], np.random.Generator] | None = None,
    ) -> None:
        self.device_id = device_id
        self.publish = publish
        self.ring_noise = ring_noise or (lambda _: np.random.default_rng())
        """The generator of a round's discrete Gaussian noise (unpredictable by default)."""
        self._round: _Round | None = None
        self._trained: tuple[tuple[str, int, str, str], LocalResult, float | None] | None = None

    def answer(
        self, announcement: RoundAnnouncement, result: LocalResult, within_clip: float | None
    ) -> tuple[DeviceUpdate, bytes]:
        """The update of a trained `result` and its blob: one masked vector, nothing in clear.

        The result is kept: if the round is announced again (a retried round, new keys), the
        same result is masked anew instead of training twice on the same personal state.
        """
        self._trained = (work_key(announcement), result, within_clip)
        masked = self.mask(
            announcement, result.shared_delta, result.num_samples, result.train_loss, within_clip
        )
        hidden = replace(result, num_samples=1, train_loss=0.0, scalars={})
        return update_message(announcement, self.device_id, hidden, masked, None)

    def answer_again(self, announcement: RoundAnnouncement) -> tuple[DeviceUpdate, bytes] | None:
        """The kept result masked with this dealing's keys, if `announcement` asks for it."""
        kept = self._trained
        if announcement.secure is None or kept is None or kept[0] != work_key(announcement):
            return None
        return self.answer(announcement, kept[1], kept[2])

    def join(self, announcement: RoundAnnouncement) -> None:
        """A secure training round asks this device: fresh keys, published."""
        if announcement.secure is None:
            return
        state = _Round(announcement.run_id, announcement.round_id, announcement.secure)
        self._round = state
        self.publish(
            SecAggKeys(
                run_id=state.run_id,
                round_id=state.round_id,
                device_id=self.device_id,
                channel_key=sa.public_hex(state.channel),
                mask_key=sa.public_hex(state.mask),
                seed_commitment=sa.seed_commitment(state.context, self.device_id, state.seed),
            )
        )

    def ready(self, announcement: RoundAnnouncement) -> bool:
        """Whether the device may train on `announcement` (its shares have been dealt)."""
        if announcement.secure is None or announcement.phase != "train":
            return True
        state = self._round
        return state is not None and state.matches(announcement) and state.dealers is not None

    def receive(self, message: Message) -> bool:
        """Act on a coordinator message; True when the device may now train.

        Raises:
            ProtocolError: a message that breaks the protocol (kept out of any state).
        """
        state = self._round
        if state is None or not state.matches(message):
            return False  # another round's, or none this device joined
        if isinstance(message, SecAggRoster):
            self._deal(state, message)
        elif isinstance(message, SecAggInbox):
            self._open_inbox(state, message)
            return state.dealers is not None
        elif isinstance(message, SecAggUnmask):
            self._reveal(state, message)
        return False

    def _deal(self, state: _Round, roster: SecAggRoster) -> None:
        if state.roster:
            return  # dealt already: a repeated roster changes nothing
        entries = {entry.device_id: entry for entry in roster.devices}
        if len(entries) != len(roster.devices) or self.device_id not in entries:
            msg = "roster repeats a device or leaves this one out"
            raise ProtocolError(msg, device_id=self.device_id, round_id=state.round_id)
        own = entries[self.device_id]
        if (own.channel_key, own.mask_key) != (
            sa.public_hex(state.channel),
            sa.public_hex(state.mask),
        ):
            msg = "roster holds other keys for this device"
            raise ProtocolError(msg, device_id=self.device_id, round_id=state.round_id)
        if len(entries) < state.secure.min_survivors:
            msg = (
                f"roster of {len(entries)}, under the round's minimum {state.secure.min_survivors}"
            )
            raise ProtocolError(msg, device_id=self.device_id, round_id=state.round_id)
        graph = sa.neighbours(sorted(entries), roster.graph_seed, state.secure.neighbors)
        state.roster, state.neighbours = entries, graph[self.device_id]
        points = sa.holder_points(sorted(entries))
        holders = [points[v] for v in state.neighbours]
        threshold = sa.threshold_of(len(holders), state.secure.threshold)
        seed_shares = sa.split_secret(state.seed, holders, threshold)
        key_shares = sa.split_secret(sa.private_bytes(state.mask), holders, threshold)
        sealed = []
        for holder in state.neighbours:
            x = points[holder]
            seed_salt, key_salt = secrets.token_bytes(16), secrets.token_bytes(16)
            bundle = seed_shares[x] + seed_salt + key_shares[x] + key_salt
            pair = sa.pair_context(state.context, self.device_id, holder)
            key = sa.agree(state.channel, entries[holder].channel_key, "channel", pair)
            sealed.append(
                SealedShares(
                    holder=holder,
                    sealed=sa.seal(key, bundle, _direction(pair, self.device_id)).hex(),
                    seed_share_commitment=sa.share_commitment(
                        state.context, self.device_id, holder, "seed", seed_shares[x], seed_salt
                    ),
                    key_share_commitment=sa.share_commitment(
                        state.context, self.device_id, holder, "key", key_shares[x], key_salt
                    ),
                )
            )
        self.publish(
            SecAggShares(
                run_id=state.run_id,
                round_id=state.round_id,
                device_id=self.device_id,
                shares=tuple(sealed),
            )
        )

    def _open_inbox(self, state: _Round, inbox: SecAggInbox) -> None:
        if state.dealers is not None or not state.roster:
            return
        dealers = set(inbox.dealers)
        if self.device_id not in dealers or not dealers <= set(state.roster):
            msg = "the dealers named are not in the roster, or leave this device out"
            raise ProtocolError(msg, device_id=self.device_id, round_id=state.round_id)
        if len(dealers) < state.secure.min_survivors:
            msg = f"{len(dealers)} dealers, under the round's minimum {state.secure.min_survivors}"
            raise ProtocolError(msg, device_id=self.device_id, round_id=state.round_id)
        neighbours = set(state.neighbours)
        for dealt in inbox.shares:
            if dealt.dealer not in dealers or dealt.dealer not in neighbours:
                continue  # not a neighbour's: nothing this device should hold
            pair = sa.pair_context(state.context, dealt.dealer, self.device_id)
            key = sa.agree(state.channel, state.roster[dealt.dealer].channel_key, "channel", pair)
            try:
                bundle = sa.unseal(key, bytes.fromhex(dealt.sealed), _direction(pair, dealt.dealer))
            except ValueError as error:
                logger.warning("device %s: share from %s: %s", self.device_id, dealt.dealer, error)
                continue
            if len(bundle) == 2 * (sa.SHARE_BYTES + sa.SALT_BYTES):
                state.held[dealt.dealer] = bundle
        state.dealers = tuple(sorted(dealers))

    def mask(
        self,
        announcement: RoundAnnouncement,
        delta: Tensors,
        num_samples: int,
        train_loss: float,
        within_clip: float | None,
    ) -> Tensors:
        """The masked update: clipped, weighted, fixed-point, plus this device's masks.

        Raises:
            ProtocolError: the round's shares were not dealt (the device must not answer).
        """
        state = self._round
        secure = announcement.secure
        if secure is None or state is None or not state.matches(announcement) or not state.dealers:
            msg = "no dealt shares for this round: a masked update could not be unmasked"
            raise ProtocolError(msg, device_id=self.device_id, round_id=announcement.round_id)
        flat = torch.cat(
            [delta[name].detach().to(torch.float64).flatten() for name in sorted(delta)]
        ).numpy()
        clipped = 0.0
        if announcement.privacy is None:  # under DP, privatize() clipped already
            norm = float(np.linalg.norm(flat))
            if norm > secure.clip_norm:
                flat, clipped = flat * (secure.clip_norm / norm), 1.0
        weight = 1.0 if secure.weight_bound == 1 else float(min(num_samples, secure.weight_bound))
        values = [weight * flat, [weight]]
        if secure.loss_bound > 0:
            loss = train_loss if math.isfinite(train_loss) else secure.loss_bound
            values += [[weight * min(max(loss, 0.0), secure.loss_bound)], [clipped]]
        layout = secure_layout(secure, flat.size, dp_bit=within_clip is not None)
        if within_clip is not None:
            values.append([within_clip])
        encoded = sa.encode(
            np.concatenate([np.asarray(v, dtype=np.float64) for v in values]), layout
        )
        privacy = announcement.privacy
        if privacy is not None and privacy.discrete:  # the delta's own integers, unclamped
            ring = noised_ring_values(
                flat,
                privacy.clip_norm,
                sa.delta_scale(secure),
                privacy.noise_std,
                self.ring_noise(announcement),
            )
            encoded[: flat.size] = ring.astype(np.uint32)
        elif secure.int8:
            encoded[: flat.size] = self._levels(announcement, weight * flat).astype(np.uint32)
        pair_seeds = {
            peer: sa.agree(
                state.mask,
                state.roster[peer].mask_key,
                "mask",
                sa.pair_context(state.context, self.device_id, peer),
            )
            for peer in set(state.neighbours).intersection(state.dealers)
        }
        masked = encoded + sa.mask_sum(layout.length, state.seed, pair_seeds, self.device_id)
        return sa.masked_tensors(masked, layout)

    def _levels(self, announcement: RoundAnnouncement, weighted: np.ndarray) -> np.ndarray:
        """The weighted delta as the round's int8 levels (within DP's clip norm under DP).

        Raises:
            ProtocolError: the round's DP cannot be kept on levels (`levels_problem`).
        """
        secure, privacy = announcement.secure, announcement.privacy
        assert secure is not None
        problem = levels_problem(privacy)
        clip = None if privacy is None else privacy.clip_norm
        try:
            if problem:
                raise ValueError(problem)
            bound = secure.weight_bound * secure.value_bound
            return int8_levels(weighted, bound, clip, self.ring_noise(announcement))
        except ValueError as error:
            raise ProtocolError(
                str(error), device_id=self.device_id, round_id=announcement.round_id
            ) from None

    def _reveal(self, state: _Round, unmask: SecAggUnmask) -> None:
        survivors = tuple(sorted(set(unmask.survivors)))
        if state.revealed_for is not None and state.revealed_for != survivors:
            msg = "asked again with other survivors: revealing more could unmask a device"
            raise ProtocolError(msg, device_id=self.device_id, round_id=state.round_id)
        if state.dealers is None or self.device_id not in survivors:
            return  # this device's input is not in the sum: it has nothing to help unmask
        if not set(survivors) <= set(state.dealers):
            msg = "survivors who never dealt shares"
            raise ProtocolError(msg, device_id=self.device_id, round_id=state.round_id)
        if len(survivors) < state.secure.min_survivors:
            msg = (
                f"only {len(survivors)} survivors, under the round's minimum "
                f"{state.secure.min_survivors}: their sum could expose one device"
            )
            raise ProtocolError(msg, device_id=self.device_id, round_id=state.round_id)
        state.revealed_for = survivors
        surviving = set(survivors)
        revealed = []
        cut = sa.SHARE_BYTES + sa.SALT_BYTES
        for dealer, bundle in sorted(state.held.items()):
            survived = dealer in surviving
            part = bundle[:cut] if survived else bundle[cut:]
            revealed.append(
                RevealedShare(
                    dealer=dealer,
                    secret="seed" if survived else "key",
                    share=part[: sa.SHARE_BYTES].hex(),
                    salt=part[sa.SHARE_BYTES :].hex(),
                )
            )
        self.publish(
            SecAggReveal(
                run_id=state.run_id,
                round_id=state.round_id,
                device_id=self.device_id,
                shares=tuple(revealed),
            )
        )


def _direction(pair: bytes, dealer: str) -> bytes:
    """Associated data of a sealed bundle: the pair and which of them dealt it."""
    return pair + b"|from|" + dealer.encode()
