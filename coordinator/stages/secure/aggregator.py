"""The coordinator's side of secure aggregation: run one attempt's phases over the transport.

The coordinator relays public keys and sealed shares it cannot open, collects masked updates,
and once they are in, asks the survivors for the shares that remove exactly the survivors' self
masks and the pairwise masks of devices that dropped out after dealing. What it learns is the
sum of the survivors' (clipped, weighted) updates and how many there were; never one update.
Each message is held to the protocol (`checks`) and the sum unmasked and checked (`unmask`): a
lying device is named where the protocol can tell who lied, and the round refused where it
cannot (masking hides which device sent an out-of-range update).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet

from coordinator.engine.intake import Collector
from coordinator.engine.silence import SilentDevices
from coordinator.stages.secure.checks import (
    checked_keys,
    checked_reveal,
    checked_shares,
    recoverable,
)
from coordinator.stages.secure.state import RoundState
from coordinator.stages.secure.unmask import SecureSum, decoded, rebuild, remove_masks
from protocols import secure_aggregation as sa
from protocols import topics
from protocols.codec import decode_frame, encode_frame, unpack_tensors
from protocols.errors import ProtocolError, RoundError
from protocols.messages import (
    DealtShares,
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
from protocols.transport.base import Transport

logger = logging.getLogger(__name__)
SHORT_PHASES = frozenset({"keys", "shares", "reveal"})
"""Phases of messages only (no training): an honest device answers them within moments."""


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


class SecureAggregator:
    """Runs secure aggregation's phases for the round engine over its transport.

    `blame(device_id, reason)` records an offence the protocol proved against a device. With
    `per_device`, the roster and the unmasking go to each device's own topic instead of the
    broadcast one: an aggregator of the tier runs a round for its group only, and the devices of
    other groups, who share the broker, must not read it as their round's.
    """

    def __init__(
        self,
        settings: sa.SecureAggregationSettings,
        transport: Transport,
        fleet: str,
        blame: Callable[[str, str], None],
        *,
        per_device: bool = False,
    ) -> None:
        self.settings = settings
        self.transport = transport
        self.fleet = fleet
        self.blame = blame
        self.per_device = per_device
        self.bytes_down = 0
        self._round: RoundState | None = None
        self._phase: Collector[object] | None = None
        self._closed: tuple[str, int] | None = None
        """The round that finished last: its late answers are expected, not offences."""
        self._silent = SilentDevices()
        """Devices that stayed connected and silent through a short phase's deadline, and have
        not been in a sum since: short phases wait for them only a grace once others are in."""
        self.late: set[str] = set()
        """Devices still connected when a phase's wait ended without their answer (stragglers),
        since the last time it was cleared; a phase that ended on `enough` leaves none."""

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
        state = RoundState(run_id, round_id, secure, tuple(specs), {}, {}, {}, {})
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
        state: RoundState,
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
            lambda: self._tell(roster, roster_message),
        )
        shares = {d: s for d, s in dealt.items() if isinstance(s, SecAggShares)}
        state.dealers = recoverable(shares, state)
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
            lambda: self._tell(state.survivors, unmask),
            enough=lambda: state.short <= 0,
        )
        reveals = [r for r in revealed.values() if isinstance(r, dict)]
        seeds = {u: rebuild(state, u, "seed", reveals, self.blame) for u in state.survivors}
        mask_keys = {v: rebuild(state, v, "key", reveals, self.blame) for v in dropped}
        if state.culprits:
            msg = (
                f"secure aggregation: {', '.join(sorted(state.culprits))} dealt shares that do "
                "not rebuild the seed or key committed to: the round cannot be unmasked"
            )
            raise RoundError(msg, round_id=state.round_id)
        total = remove_masks(state, masked_inputs, seeds, mask_keys)  # type: ignore[arg-type]
        secure_sum = decoded(state, total, dropped)
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
        if enough is None or not enough():
            self.late |= collector.outstanding(online())
        return {d: collector.answers[d] for d in sorted(collector.answers)}

    def _send_inboxes(self, state: RoundState, shares: dict[str, SecAggShares]) -> None:
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

    def _enough(self, state: RoundState, what: str, devices: Sequence[str]) -> None:
        if len(devices) < state.secure.min_survivors:
            msg = (
                f"secure aggregation: only {len(devices)} devices {what} "
                f"(at least {state.secure.min_survivors} needed)"
            )
            raise RoundError(msg, round_id=state.round_id)

    def _tell(self, devices: Sequence[str], message: Message) -> None:
        """`message` for every one of `devices`: broadcast once, or once to each (`per_device`)."""
        if not self.per_device:
            self._send(topics.secure(self.fleet), message, len(devices))
            return
        payload = encode_frame(message)
        for device_id in devices:
            self.transport.publish(topics.secure(self.fleet, device_id), payload)
        self.bytes_down += len(payload) * len(devices)

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
            answer = checked_keys(message, state)
        elif isinstance(message, SecAggShares) and phase.phase == "shares":
            answer = checked_shares(message, state)
        elif isinstance(message, SecAggReveal) and phase.phase == "reveal":
            answer = checked_reveal(message, state)
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
        layout = state.layout()
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
