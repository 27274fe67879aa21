"""The coordinator's side of secure aggregation: run the phases, rebuild secrets, unmask the sum.

The coordinator relays public keys and sealed shares it cannot open, collects masked updates,
and once they are in, asks the survivors for the shares that remove exactly the survivors' self
masks and the pairwise masks of devices that dropped out after dealing. What it learns is the
sum of the survivors' (clipped, weighted) updates and how many there were; never one update.
Every revealed share is checked against its dealer's commitment, every rebuilt secret against
the dealer's public key or seed commitment, and the sum against what honest devices can send:
a lying device is named where the protocol can tell who lied, and the round refused where it
cannot (masking hides which device sent an out-of-range update).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from coordinator.engine.intake import Collector
from coordinator.engine.silence import SilentDevices
from coordinator.stages.aggregate_guard import cap_shares
from coordinator.strategies.base import ReceivedUpdate, Strategy
from protocols import secure_aggregation as sa
from protocols import topics
from protocols.codec import Tensors, decode_frame, encode_frame, unpack_tensors
from protocols.errors import ProtocolError, RoundError
from protocols.messages import (
    DealtShares,
    DevicePrivacy,
    DeviceUpdate,
    Message,
    RosterEntry,
    SecAggInbox,
    SecAggKeys,
    SecAggReveal,
    SecAggRoster,
    SecAggShares,
    SecAggUnmask,
    SecureRound,
    TensorSpec,
)
from protocols.secure_aggregation import secure_layout
from protocols.secure_levels import LEVELS
from protocols.transport.base import Transport

logger = logging.getLogger(__name__)
MIN_COHORT = 3
"""Fewer devices never aggregate securely: the sum of two tells each the other's update."""
NOISE_ROOM = 8.0
"""Each entry's clamp leaves this many noise standard deviations above the clip norm."""
SHORT_PHASES = frozenset({"keys", "shares", "reveal"})
"""Phases of messages only (no training): an honest device answers them within moments."""


def weight_bound(
    strategy: Strategy, declared: Sequence[int | None], private: bool, max_share: float
) -> int:
    """The largest weight a device may give its update: 1 for a uniform mean, else samples.

    Capped by water-filling the cohort's declared counts (`cap_shares`), as plain rounds cap
    the counts their updates claim: a hello declaring a huge data set cannot make its masked
    update outweigh the rest, nor coarsen everyone's fixed point with a huge bound.
    """
    if private or getattr(strategy.config, "aggregation_weights", "") == "uniform":
        return 1
    counts = [d for d in declared if d is not None and d > 0]
    return max([1, *cap_shares(counts, max_share)])


class SecureRoundError(RoundError):
    """A secure round that did not give a sum: whom it proved a liar, whether a sum was seen."""

    def __init__(
        self,
        message: str,
        *,
        culprits: AbstractSet[str] = frozenset(),
        gone: AbstractSet[str] = frozenset(),
        unmasked: int = 0,
    ) -> None:
        super().__init__(message)
        self.culprits = frozenset(culprits)
        """Dealers whose shares rebuild another secret than they committed to."""
        self.gone = frozenset(gone)
        """Devices that declined, went offline or were quarantined during the round."""
        self.unmasked = unmasked
        """Devices in a sum that was unmasked and refused (0: the coordinator saw no sum)."""


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


@dataclass
class _Round:
    """One round's protocol state, filled phase by phase."""

    run_id: str
    round_id: int
    secure: SecureRound
    specs: tuple[TensorSpec, ...]
    keys: dict[str, SecAggKeys]
    neighbours: dict[str, tuple[str, ...]]
    points: dict[str, int]
    commitments: dict[tuple[str, str], tuple[str, str]]
    dealers: tuple[str, ...] = ()
    survivors: tuple[str, ...] = ()
    revealed: dict[tuple[str, str], int] = field(default_factory=dict)
    """Shares accepted so far per (dealer, secret) in the unmasking."""
    short: int = 0
    """Secrets the unmasking needs that have fewer shares than their threshold yet."""
    gone: set[str] = field(default_factory=set)
    """Devices that declined or were quarantined: no later phase of the round waits for them."""
    culprits: set[str] = field(default_factory=set)
    unmasked: int = 0

    @property
    def context(self) -> bytes:
        return sa.round_context(self.run_id, self.round_id)

    def threshold(self, device_id: str) -> int:
        return sa.threshold_of(len(self.neighbours[device_id]), self.secure.threshold)


Reveals = dict[tuple[str, str], tuple[int, bytes]]
"""What one holder revealed: (dealer, "seed" or "key") -> (its Shamir point, the share)."""


class SecureAggregator:
    """Runs secure aggregation's phases for the round engine over its transport.

    `blame(device_id, reason)` records an offence the protocol proved against a device.
    """

    def __init__(
        self,
        settings: sa.SecureAggregationSettings,
        transport: Transport,
        fleet: str,
        blame: Callable[[str, str], None],
    ) -> None:
        self.settings = settings
        self.transport = transport
        self.fleet = fleet
        self.blame = blame
        self.bytes_down = 0
        self._round: _Round | None = None
        self._phase: Collector[object] | None = None
        self._closed: tuple[str, int] | None = None
        """The round that finished last: its late answers are expected, not offences."""
        self._silent = SilentDevices()
        """Devices that stayed connected and silent through a short phase's deadline, and have
        not been in a sum since: short phases wait for them only a grace once others are in."""

    def plan(
        self,
        selected: Sequence[str],
        privacy: DevicePrivacy | None,
        weights: int,
        needed: int,
    ) -> SecureRound:
        """What the round's announcement tells devices.

        Raises:
            RoundError: fewer than 3 devices selected (a sum of two tells each the other's).
        """
        if len(selected) < MIN_COHORT:
            msg = (
                f"secure aggregation needs at least 3 devices a round, {len(selected)} selected: "
                "the sum of two would tell each device the other's update"
            )
            raise RoundError(msg)
        noise = privacy.noise_std if privacy is not None else 0.0
        clip = privacy.clip_norm if privacy is not None else self.settings.clip_norm
        return SecureRound(
            threshold=self.settings.threshold,
            neighbors=self.settings.neighbors,
            cohort=len(selected),
            min_survivors=max(MIN_COHORT, needed),
            clip_norm=clip,
            value_bound=clip + NOISE_ROOM * noise,
            weight_bound=weights,
            loss_bound=0.0 if privacy is not None else self.settings.loss_bound,
            bit_bound=(
                1 + NOISE_ROOM * privacy.indicator_std
                if privacy is not None and privacy.report_clipped
                else 0.0
            ),
            phase_timeout_s=self.settings.phase_timeout_s,
            int8=self.settings.int8,
        )

    # -- the phases ---------------------------------------------------------------------------

    def run(
        self,
        run_id: str,
        round_id: int,
        secure: SecureRound,
        selected: Sequence[str],
        specs: Sequence[TensorSpec],
        online: Callable[[], AbstractSet[str]],
        train_timeout_s: float,
        announce: Callable[[], None],
    ) -> SecureSum:
        """Announce, then keys, roster, shares, masked updates, unmasking: the survivors' sum.

        Each phase opens before the message that starts it goes out, so no quick answer
        arrives before it is expected.

        Raises:
            SecureRoundError: too few devices at some phase, a secret that cannot be rebuilt, or a
                sum no honest devices could have sent.
        """
        state = _Round(run_id, round_id, secure, tuple(specs), {}, {}, {}, {})
        self._round = state
        try:
            return self._run(state, selected, online, train_timeout_s, announce)
        except RoundError as error:
            gone = state.gone | (set(selected) - online())
            raise SecureRoundError(
                str(error),
                culprits=state.culprits,
                gone=gone,
                unmasked=state.unmasked,
            ) from error
        finally:
            self._round, self._phase, self._closed = None, None, (run_id, round_id)

    def _run(
        self,
        state: _Round,
        selected: Sequence[str],
        online: Callable[[], AbstractSet[str]],
        train_timeout_s: float,
        announce: Callable[[], None],
    ) -> SecureSum:
        secure = state.secure
        keys = self._collect("keys", set(selected), online, secure.phase_timeout_s, announce)
        state.keys = {
            d: k for d, k in keys.items() if isinstance(k, SecAggKeys) and d not in state.gone
        }
        roster = sorted(state.keys)
        self._enough(state, "advertised keys", roster)
        graph_seed = secrets.token_hex(32)
        state.neighbours = sa.neighbours(roster, graph_seed, secure.neighbors)
        state.points = sa.holder_points(roster)
        entries = tuple(
            RosterEntry(device_id=d, channel_key=k.channel_key, mask_key=k.mask_key)
            for d, k in sorted(state.keys.items())
        )
        roster_message = SecAggRoster(
            run_id=state.run_id, round_id=state.round_id, graph_seed=graph_seed, devices=entries
        )
        dealt = self._collect(
            "shares",
            set(roster),
            online,
            secure.phase_timeout_s,
            lambda: self._send(topics.secure(self.fleet), roster_message, len(roster)),
        )
        shares = {d: s for d, s in dealt.items() if isinstance(s, SecAggShares)}
        state.dealers = _recoverable(shares, state)
        self._enough(state, "dealt shares", state.dealers)
        masked_inputs = self._collect(
            "masked",
            set(state.dealers),
            online,
            train_timeout_s,
            lambda: self._send_inboxes(state, shares),
        )
        state.survivors = tuple(sorted(masked_inputs))
        self._enough(state, "masked updates", state.survivors)
        dropped = tuple(d for d in state.dealers if d not in masked_inputs)
        state.short = len(state.survivors) + len(dropped)
        unmask = SecAggUnmask(
            run_id=state.run_id, round_id=state.round_id, survivors=state.survivors
        )
        revealed = self._collect(
            "reveal",
            set(state.survivors),
            online,
            secure.phase_timeout_s,
            lambda: self._send(topics.secure(self.fleet), unmask, len(state.survivors)),
            enough=lambda: state.short <= 0,
        )
        reveals = [r for r in revealed.values() if isinstance(r, dict)]
        seeds = {u: self._rebuild(state, u, "seed", reveals) for u in state.survivors}
        mask_keys = {v: self._rebuild(state, v, "key", reveals) for v in dropped}
        if state.culprits:
            msg = (
                f"secure aggregation: {', '.join(sorted(state.culprits))} dealt shares that do "
                "not rebuild the seed or key committed to: the round cannot be unmasked"
            )
            raise RoundError(msg, round_id=state.round_id)
        total = _unmask(state, masked_inputs, seeds, mask_keys)  # type: ignore[arg-type]
        secure_sum = _decoded(state, total, dropped)
        self._silent.heard(state.survivors)  # they did their part of a whole round
        return secure_sum

    def _collect(
        self,
        phase: str,
        expected: set[str],
        online: Callable[[], AbstractSet[str]],
        timeout_s: float,
        send: Callable[[], None],
        enough: Callable[[], bool] | None = None,
    ) -> dict[str, object]:
        """Open `phase`, `send` what starts it, wait until it settles; its answers by device.

        A device that was silent through an earlier short phase's deadline is waited for only a
        grace once everyone else is in; one silent through this one's deadline becomes such.
        """
        state = self._round
        assert state is not None
        collector: Collector[object] = Collector(state.round_id, phase, expected)
        for device_id in state.gone:
            collector.decline(device_id)
        self._phase = collector
        send()
        if phase in SHORT_PHASES:
            self._silent.wait(self.transport, collector, online, timeout_s, enough)
        else:  # training takes its time: a device silent in a short phase gets all of it
            self.transport.wait_until(
                lambda: collector.settled(online()) or (enough is not None and enough()),
                timeout_s,
            )
        self._phase = None
        return {d: collector.answers[d] for d in sorted(collector.answers)}

    def _send_inboxes(self, state: _Round, shares: dict[str, SecAggShares]) -> None:
        """Each dealer's (U2) device gets the dealers' list and the shares sealed for it."""
        inboxes: dict[str, list[DealtShares]] = {holder: [] for holder in state.dealers}
        for dealer in state.dealers:
            for sealed in shares[dealer].shares:
                if sealed.holder in inboxes:
                    inboxes[sealed.holder].append(DealtShares(dealer=dealer, sealed=sealed.sealed))
        for holder, dealt in inboxes.items():
            inbox = SecAggInbox(
                run_id=state.run_id,
                round_id=state.round_id,
                dealers=state.dealers,
                shares=tuple(dealt),
            )
            self._send(topics.secure(self.fleet, holder), inbox, 1)

    def _enough(self, state: _Round, what: str, devices: Sequence[str]) -> None:
        if len(devices) < state.secure.min_survivors:
            msg = (
                f"secure aggregation: only {len(devices)} devices {what} "
                f"(at least {state.secure.min_survivors} needed)"
            )
            raise RoundError(msg, round_id=state.round_id)

    def _send(self, topic: str, message: Message, recipients: int) -> None:
        payload = encode_frame(message)
        self.transport.publish(topic, payload)
        self.bytes_down += len(payload) * recipients

    # -- what devices send --------------------------------------------------------------------

    def active(self) -> bool:
        """Whether a secure round is collecting now."""
        return self._round is not None

    def decline(self, device_id: str, round_id: int | None = None) -> None:
        """A device will not answer (skipped round `round_id`, or quarantined): stop waiting.

        It stays out of every later phase of the round, so no phase waits for it in vain.
        """
        state, phase = self._round, self._phase
        if state is None or (round_id is not None and round_id != state.round_id):
            return
        state.gone.add(device_id)
        if phase is not None:
            phase.decline(device_id)

    def on_message(self, topic: str, payload: bytes) -> None:
        """A device's keys, shares or reveal.

        Raises:
            ProtocolError, RoundError: the message breaks the protocol or answers no open phase.
        """
        sender = topics.parse_topic(topic).device_id or ""
        message, _ = decode_frame(payload)
        state, phase = self._round, self._phase
        if getattr(message, "device_id", None) != sender:
            msg = f"{message.kind} names another device than its topic"
            raise ProtocolError(msg, device_id=sender, topic=topic)
        if self._late(message):
            return
        if state is None or phase is None or getattr(message, "run_id", None) != state.run_id:
            msg = f"{message.kind} outside a secure round of this run"
            raise RoundError(msg, device_id=sender, topic=topic)
        if getattr(message, "round_id", None) != state.round_id:
            msg = f"{message.kind} for another round"
            raise RoundError(msg, device_id=sender, topic=topic)
        answer: object
        if isinstance(message, SecAggKeys) and phase.phase == "keys":
            answer = _checked_keys(message, state)
        elif isinstance(message, SecAggShares) and phase.phase == "shares":
            answer = _checked_shares(message, state)
        elif isinstance(message, SecAggReveal) and phase.phase == "reveal":
            answer = _checked_reveal(message, state)
        else:
            msg = f"{message.kind} while collecting {phase.phase}"
            raise RoundError(msg, device_id=sender, round_id=state.round_id, topic=topic)
        if not phase.offer(sender, answer):
            msg = f"{message.kind} from a device not asked, or sent twice"
            raise RoundError(msg, device_id=sender, round_id=state.round_id, topic=topic)
        if isinstance(answer, dict):  # a reveal: count its shares towards each threshold
            for dealer, kind in answer:
                count = state.revealed.get((dealer, kind), 0) + 1
                state.revealed[(dealer, kind)] = count
                if count == state.threshold(dealer):
                    state.short -= 1

    def on_update(self, update: DeviceUpdate, blob: bytes) -> None:
        """A masked update: one int32 vector of the round's layout.

        Raises:
            ProtocolError, RoundError: another layout, or no masked update is being collected.
        """
        state, phase = self._round, self._phase
        if self._late(update):
            return
        if state is None or phase is None or phase.phase != "masked":
            msg = "a masked update while none is collected"
            raise RoundError(msg, device_id=update.device_id, round_id=update.round_id)
        if update.run_id != state.run_id or update.round_id != state.round_id:
            msg = "a masked update for another round"
            raise RoundError(msg, device_id=update.device_id, round_id=update.round_id)
        layout = _layout(state)
        tensors = unpack_tensors(update.manifest, blob, expected=sa.masked_specs(layout))
        try:
            vector = sa.masked_vector(tensors, layout)
        except ValueError as error:
            raise ProtocolError(
                str(error), device_id=update.device_id, round_id=update.round_id
            ) from None
        if not phase.offer(update.device_id, vector):
            msg = "a masked update from a device that did not deal, or sent twice"
            raise RoundError(msg, device_id=update.device_id, round_id=update.round_id)

    def _late(self, message: Message) -> bool:
        """An answer to the round that just closed (e.g. a reveal once enough were in)."""
        key = (getattr(message, "run_id", None), getattr(message, "round_id", None))
        if self._round is None and key == self._closed:
            kind = getattr(message, "kind", "message")
            logger.debug("late %s from %s", kind, getattr(message, "device_id", "?"))
            return True
        return False

    # -- unmasking ----------------------------------------------------------------------------

    def _rebuild(
        self, state: _Round, dealer: str, kind: sa.SealedKind, reveals: list[Reveals]
    ) -> bytes | None:
        """The dealer's secret; None (the dealer blamed) when its shares rebuild another one."""
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
            self.blame(dealer, reason)
            state.culprits.add(dealer)
            return None
        return secret


def _layout(state: _Round) -> sa.Layout:
    length = sum(int(np.prod(spec.shape)) for spec in state.specs)
    return secure_layout(state.secure, length, dp_bit=state.secure.bit_bound > 0)


def _checked_keys(message: SecAggKeys, state: _Round) -> SecAggKeys:
    """Both public keys are usable: one low-order key would stop every neighbour dealing."""
    for key in (message.channel_key, message.mask_key):
        problem = sa.public_key_problem(key)
        if problem:
            raise ProtocolError(problem, device_id=message.device_id, round_id=state.round_id)
    if message.channel_key == message.mask_key:
        msg = "the same key for sealing and masking: revealing one would open the other"
        raise ProtocolError(msg, device_id=message.device_id, round_id=state.round_id)
    return message


def _checked_shares(message: SecAggShares, state: _Round) -> SecAggShares:
    """A dealer's shares go to exactly its neighbours; their commitments are kept."""
    dealer = message.device_id
    holders = [s.holder for s in message.shares]
    if sorted(holders) != sorted(state.neighbours.get(dealer, ())):
        msg = "shares not dealt to exactly this device's neighbours"
        raise ProtocolError(msg, device_id=dealer, round_id=state.round_id)
    for sealed in message.shares:
        pair = (dealer, sealed.holder)
        state.commitments[pair] = (sealed.seed_share_commitment, sealed.key_share_commitment)
    return message


def _recoverable(shares: dict[str, SecAggShares], state: _Round) -> tuple[str, ...]:
    """The dealers whose secrets enough dealing neighbours hold (U2), to a fixed point."""
    dealers = set(shares)
    while True:
        kept = {d for d in dealers if len(set(state.neighbours[d]) & dealers) >= state.threshold(d)}
        if kept == dealers:
            return tuple(sorted(kept))
        dealers = kept


def _checked_reveal(message: SecAggReveal, state: _Round) -> Reveals:
    """Each revealed share is one the holder was dealt, of the right secret, as committed."""
    holder = message.device_id
    dealers, survivors = set(state.dealers), set(state.survivors)
    out: Reveals = {}
    for revealed in message.shares:
        dealer = revealed.dealer
        wanted: sa.SealedKind = "seed" if dealer in survivors else "key"
        commitment = state.commitments.get((dealer, holder))
        if dealer not in dealers or commitment is None or (dealer, wanted) in out:
            msg = f"revealed a share of {dealer} it was not dealt (or twice)"
            raise ProtocolError(msg, device_id=holder, round_id=state.round_id)
        if revealed.secret != wanted:
            msg = f"revealed {dealer}'s {revealed.secret} share, the unmasking asks its {wanted}"
            raise ProtocolError(msg, device_id=holder, round_id=state.round_id)
        share, salt = bytes.fromhex(revealed.share), bytes.fromhex(revealed.salt)
        expected = commitment[0] if wanted == "seed" else commitment[1]
        actual = sa.share_commitment(state.context, dealer, holder, wanted, share, salt)
        if not sa.constant_time_equal(actual, expected):
            msg = f"revealed a share of {dealer} other than the one dealt to it"
            raise ProtocolError(msg, device_id=holder, round_id=state.round_id)
        out[(dealer, wanted)] = (state.points[holder], share)
    return out


def _unmask(
    state: _Round,
    masked: dict[str, np.ndarray],
    seeds: dict[str, bytes],
    mask_keys: dict[str, bytes],
) -> np.ndarray:
    """Sum of the masked inputs minus the survivors' self masks and the dropped pairs' masks."""
    length = _layout(state).length
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


def _decoded(state: _Round, total: np.ndarray, dropped: tuple[str, ...]) -> SecureSum:
    """The real-valued sums, checked against what honest survivors can send.

    Raises:
        RoundError: a sum out of that range (a device sent an out-of-range masked vector).
    """
    secure, layout = state.secure, _layout(state)
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
