"""The device agent: hears rounds, trains with its algorithm's local update, reports deltas.

It does the I/O around the math: decoding, personal state load/save, seeds, status and errors.
The same object serves a real device over MQTT and a virtual device in simulation; handlers run
one at a time on the transport's dispatch thread.
"""

from __future__ import annotations

import logging
import secrets

from torch import nn

from device_agent.agent_exports import AgentExports
from device_agent.algorithms.base import LocalContext, LocalResult, LocalUpdate
from device_agent.attacks import HONEST, Attack
from device_agent.batched.trainer import Immediate, LocalTrainer
from device_agent.capabilities import probe_capabilities
from device_agent.compute_threads import StepThreads, threads_for
from device_agent.context import LocalDevice, RoundContexts
from device_agent.downloads import ModelDownloads, rebuild_from_delta
from device_agent.egress import Egress, will_frame
from device_agent.eligibility import EligibilityPolicy
from device_agent.evaluation import evaluated
from device_agent.exporting import answer_export_command
from device_agent.received import DecodedModelCache, ReceivedFrames, ReceivedModel
from device_agent.relay import RelayClient
from device_agent.replies import evaluation_report, sighting, work_key
from device_agent.secure_aggregation import SecureClient
from device_agent.state_store import StateStore
from device_agent.training import ModelSlots, StepBudget
from device_agent.uplink import Uplink
from device_agent.work_limits import WorkLimits
from pfl_tasks.base import DeviceData, Task
from protocols import topics
from protocols.codec import Tensors, decode_frame
from protocols.errors import PflError, ProtocolError, TrainingError
from protocols.messages import (
    Capabilities,
    Command,
    DeviceHello,
    DeviceStatus,
    MemoryPlan,
    Message,
    ModelDelta,
    PeerModels,
    RoundAnnouncement,
    SharedModel,
)
from protocols.transport.base import Transport, Will

logger = logging.getLogger(__name__)


def device_will(fleet: str, device_id: str, *, strict_egress: bool = False) -> Will:
    """The retained "offline" status the broker publishes if the device vanishes."""
    status = DeviceStatus(device_id=device_id, state="offline", detail="connection lost")
    frame = will_frame(status, strict=strict_egress)
    return Will(topics.device(fleet, device_id, "status"), frame)


class DeviceAgent:
    """One device of the fleet, real or virtual.

    Args:
        workspace: the nn.Module training happens in; virtual devices share one.
        initial_state: the task model's initial tensors, where personal state starts.
        limits: this device's ceilings on one round's work (None: none, as for virtual devices).
        threads: torch threads for each round's batch size (None: the process's setting, as
            for simulation workers, which choose for all their devices).
        attack: how a malicious virtual device lies (simulation only; `HONEST` changes nothing).
        strict_egress: release nothing outside DP's guarantee (see `device_agent.egress`).
        reproducible_noise: DP noise drawn from the device's seed, the same for any number of
            simulation workers (see `RoundContexts`).
        trainer: where the local update runs (None: at once; a simulation may batch its
            virtual devices' updates, see `device_agent.batched`).
    """

    def __init__(
        self,
        *,
        device_id: str,
        fleet: str,
        transport: Transport,
        task: Task,
        data: DeviceData,
        seed: int,
        store: StateStore,
        workspace: nn.Module,
        initial_state: Tensors,
        stateful: bool = True,
        budget: StepBudget | None = None,
        memory_plan: MemoryPlan | None = None,
        capabilities: Capabilities | None = None,
        model_cache: DecodedModelCache | None = None,
        memory_budget_bytes: int | None = None,
        eligibility: EligibilityPolicy | None = None,
        limits: WorkLimits | None = None,
        threads: StepThreads | None = None,
        attack: Attack = HONEST,
        strict_egress: bool = False,
        reproducible_noise: bool = False,
        trainer: LocalTrainer | None = None,
    ) -> None:
        self.device_id = device_id
        self.attack = attack
        self.fleet = fleet
        self.transport = transport
        self.egress = Egress(transport, fleet, device_id, strict=strict_egress)
        """Every message this device sends goes out through it."""
        self.task = task
        self.data = data
        self.store = store
        self.workspace = workspace
        self.stateful = stateful
        self.capabilities = capabilities
        self.eligibility = eligibility or EligibilityPolicy()
        self.model_cache = model_cache or DecodedModelCache()
        self.contexts = RoundContexts(
            LocalDevice(device_id, task, data, seed, store, workspace, initial_state, stateful),
            budget=budget or StepBudget(),
            model_cache=self.model_cache,
            memory_budget_bytes=memory_budget_bytes,
            limits=limits,
            reproducible_noise=reproducible_noise,
        )
        self.memory_plan = self.contexts.plan_memory_at_start() or memory_plan
        self.received = ReceivedFrames.for_store(store, device_id)  # kept for offline export
        self.relay = RelayClient(device_id, self.contexts.model_layout, self.received)
        self.exports = AgentExports(self.contexts, self.relay, self._latest_received)
        """Its personalized model to ONNX, for the export command and `pfl-agent export`."""
        self._slots = ModelSlots(workspace)
        self.threads = threads
        self.last_loss: float | None = None
        self._model: ReceivedModel | None = None
        self._pending: dict[str, tuple[RoundAnnouncement, bytes]] = {}
        """Work waiting for its model, one per phase: an evaluation announced while an
        asynchronous job is still fetching does not replace that job."""
        self._export_command: Command | None = None  # waiting for the model it exports
        self.downloads = ModelDownloads(transport, fleet, self._on_model, self._on_model_delta)
        self._answered: set[tuple[str, int, str, float]] = set()
        self._reply: tuple[tuple[str, int, str, str], Message, bytes] | None = None
        self.last_announcement: RoundAnnouncement | None = None  # what export personalizes with
        self._last_frame = b""
        self.instance = secrets.token_hex(8)  # tells two processes with one id apart
        self.secure = SecureClient(  # late-bound: what the gate is then, every message
            device_id, lambda message: self.egress.send(message), self.contexts.ring_noise
        )
        self.uplink = Uplink(device_id, self.contexts, self.secure, lambda r: self.attack.forge(r))
        self._stopping = False
        self.trainer = trainer or Immediate()

    def start(self) -> None:
        """Subscribe to the fleet's topics (the model only when needed), then say hello.

        From now on every reconnect says hello again: a restarted broker forgot this device.
        """
        self.transport.on_reconnect(self.rejoin)
        self.downloads.clear()
        self.transport.subscribe(topics.round_announcement(self.fleet), self._on_round)
        self.transport.subscribe(topics.command(self.fleet), self._on_command)
        self.transport.subscribe(topics.command(self.fleet, self.device_id), self._on_command)
        self.transport.subscribe(topics.relay(self.fleet, self.device_id), self._on_relay)
        self.transport.subscribe(topics.secure(self.fleet), self._on_secure)
        self.transport.subscribe(topics.secure(self.fleet, self.device_id), self._on_secure)
        own_status = topics.device(self.fleet, self.device_id, "status")
        self.transport.subscribe(own_status, self._on_own_status)
        self.publish_status("online")
        self.say_hello()

    def rejoin(self) -> None:
        """After a reconnect: re-publish liveness (a restarted broker lost it) and say hello."""
        self.publish_status("online")
        self.say_hello()

    def stop(self) -> None:
        """Leave cleanly: retained status "offline", then disconnect."""
        self._stopping = True
        self.publish_status("offline", detail="stopped")
        self.transport.close()

    def say_hello(self) -> None:
        """Announce this device and its capabilities to the coordinator."""
        hello = DeviceHello(
            device_id=self.device_id,
            task=self.task.name,
            num_train_samples=self.attack.declared_samples(len(self.data.train)),
            capabilities=self.capabilities or probe_capabilities(),
            memory_plan=self.memory_plan,
            stateful=self.stateful,
            instance=self.instance,
            eligibility=self.eligibility.as_wire(),
        )
        self.egress.send(hello)

    def publish_status(
        self,
        state: str,
        *,
        round_id: int | None = None,
        detail: str = "",
        run_id: str | None = None,
    ) -> None:
        """Retained liveness and progress for `pfl-coord status`."""
        status = DeviceStatus(
            device_id=self.device_id,
            state=state,  # type: ignore[arg-type]
            round_id=round_id,
            run_id=run_id,
            last_loss=self.last_loss,
            detail=detail[:1024],
        )
        self.egress.send(status)

    # -- handlers ---------------------------------------------------------------------------

    def _on_model(self, topic: str, payload: bytes) -> None:
        message, blob = self.model_cache.frame(payload)
        if not isinstance(message, SharedModel):
            msg = f"expected a shared model, got {message.kind}"
            raise ProtocolError(msg, topic=topic)
        received = ReceivedModel(message, blob)
        # validated on arrival: a corrupt model is dropped and the previous one stays usable
        self.model_cache.decode(received, self.contexts.model_layout)
        self._hold(received, payload)

    def _on_model_delta(self, topic: str, payload: bytes) -> None:
        message, blob = self.model_cache.frame(payload)
        if not isinstance(message, ModelDelta):
            msg = f"expected a model delta, got {message.kind}"
            raise ProtocolError(msg, topic=topic)
        if self._model is None or message.target_sha256 != self.downloads.wanted:
            return  # not the step this device waits for (an older retained copy)
        try:
            received, frame = rebuild_from_delta(
                self._model, message, blob, self.contexts.model_layout, self.model_cache
            )
        except ProtocolError:
            self.downloads.fetch("model")  # whatever went wrong, the whole model will do
            raise
        self._hold(received, frame)

    def _hold(self, model: ReceivedModel, frame: bytes) -> None:
        """A valid model arrived: keep it, stop fetching it, do the work that waited for it."""
        self._model = model
        self.received.remember_model(model.header, frame)
        self.downloads.arrived(model.header.manifest.sha256)
        self._serve_pending()
        if self._export_command is not None and self.downloads.wanted is None:
            command, self._export_command = self._export_command, None
            self._answer_export(command)

    def _on_round(self, topic: str, payload: bytes) -> None:
        message, _ = self.model_cache.frame(payload)
        if not isinstance(message, RoundAnnouncement):
            msg = f"expected a round announcement, got {message.kind}"
            raise ProtocolError(msg, topic=topic)
        self.last_announcement = message
        self._last_frame = payload
        if message.addresses(self.device_id) and sighting(message) not in self._answered:
            reason = self.uplink.open(message, lambda: self._reason_to_skip(message))
            if reason is not None:  # declined before the uplink set anything up
                self._answered.add(sighting(message))
                self._decline(message, reason)
                return
            self._pending[message.phase] = (message, payload)
            self._serve_pending()

    def _on_secure(self, topic: str, payload: bytes) -> None:
        """Secure aggregation's roster, this device's inbox, or the unmasking."""
        message, _ = decode_frame(payload)
        if self.secure.receive(message):
            self._serve_pending()  # its shares are dealt: the round may train now

    def _on_own_status(self, topic: str, payload: bytes) -> None:
        """Our id marked offline while we run: say we are here.

        That is the will of a connection the broker dropped, e.g. when another client with
        this id took our session over and then left.
        """
        try:
            message, _ = decode_frame(payload)
        except PflError:
            return  # only a liveness hint: whatever else lands here is not this agent's concern
        if isinstance(message, DeviceStatus) and message.state == "offline" and not self._stopping:
            logger.info("device %s: marked offline while running; saying hello", self.device_id)
            self.rejoin()

    def _on_command(self, topic: str, payload: bytes) -> None:
        message, _ = decode_frame(payload)
        if not isinstance(message, Command):
            msg = f"expected a command, got {message.kind}"
            raise ProtocolError(msg, topic=topic)
        if message.action == "hello":
            self.say_hello()
        elif message.action == "reset-state":
            self.store.clear()
            logger.info("device %s: personal state cleared on request", self.device_id)
        elif message.action == "export":
            announced = self.last_announcement
            held = None if self._model is None else self._model.header.manifest.sha256
            if announced is None or held == announced.model_sha256:
                self._answer_export(message)
            else:  # not asked lately: fetch the model retained now, answer when it is here
                self._export_command = message
                self.downloads.latest()

    def _answer_export(self, command: Command) -> None:
        if self.last_announcement is not None:
            self.received.remember_round(self.last_announcement, self._last_frame)
        report = answer_export_command(
            self.exports.source(), command, self.store, self.publish_status
        )
        self.egress.send(report)

    def _latest_received(self) -> tuple[RoundAnnouncement | None, ReceivedModel | None]:
        return self.last_announcement, self._model

    def _on_relay(self, topic: str, payload: bytes) -> None:
        message, blob = decode_frame(payload)
        if not isinstance(message, PeerModels):
            msg = f"expected relayed models, got {message.kind}"
            raise ProtocolError(msg, topic=topic)
        announcement, model, models = self.relay.receive(message, blob)
        self._work(announcement, model, models)

    def _serve_pending(self) -> None:
        for phase, (announcement, frame) in list(self._pending.items()):
            if not self.downloads.holds_for(announcement, self._model) or self._model is None:
                continue  # the announced model is on its way
            if not self.uplink.ready(announcement):
                continue  # e.g. secure aggregation deals its shares before anyone trains
            del self._pending[phase]
            self._serve(announcement, frame, self._model)

    def _serve(self, announcement: RoundAnnouncement, frame: bytes, model: ReceivedModel) -> None:
        """Do announced work whose model is here, or answer it again if it was done."""
        self.received.remember_round(announcement, frame)  # kept with the model it uses
        self._answered.add(sighting(announcement))
        again = self.uplink.again(announcement)
        if again is not None:  # e.g. a secure round announced again: the result, masked anew
            self.egress.send(*again, answering=announcement)
            return
        if self._reply is not None and self._reply[0] == work_key(announcement):
            # The same work announced again (a retried round or a restarted coordinator):
            # re-send the answer instead of training twice on the same personal state.
            self.egress.send(self._reply[1], self._reply[2], answering=announcement)
            return
        reason = self._reason_to_skip(announcement)
        if reason is not None:
            logger.info(
                "device %s skips the %s of round %d: %s",
                self.device_id,
                announcement.phase,
                announcement.round_id,
                reason,
            )
            self._decline(announcement, reason)
            return
        self._work(announcement, model)

    def _reason_to_skip(self, announcement: RoundAnnouncement) -> str | None:
        """Why this device declines `announcement`'s work now (None: it answers)."""
        refusal = self.egress.refusal(announcement)
        if refusal is None and announcement.phase == "train":
            return self.eligibility.reason_to_skip()
        return refusal

    def _work(
        self,
        announcement: RoundAnnouncement,
        model: ReceivedModel,
        peer_models: dict[str, Tensors] | None = None,
    ) -> None:
        """Train or evaluate; a relay algorithm first asks for its models (then `_on_relay`)."""
        try:
            if announcement.phase not in ("train", "evaluate"):
                return
            plan = self.contexts.plan_work(announcement)
            with threads_for(self.threads, min(plan.config.batch_size, len(self.data.train))):
                update, ctx = self.contexts.build(announcement, model, peer_models)
                if peer_models is None and self.relay.wants_models(plan.update):
                    request = self.relay.request(announcement, model, update, ctx)
                    self.egress.send(request, answering=announcement)
                elif announcement.phase == "train":
                    self._train(announcement, update, ctx)
                else:
                    self._evaluate(announcement, model, update, ctx)
        except Exception as error:  # any local failure declines the round, never hangs it
            self._failed(announcement, error)

    def _failed(self, announcement: RoundAnnouncement, error: Exception) -> None:
        """Decline `announcement`'s work because of `error`, logged."""
        if not isinstance(error, PflError):
            logger.debug("device %s: local failure", self.device_id, exc_info=error)
            error = TrainingError(f"{type(error).__name__}: {error}", device_id=self.device_id)
        logger.warning(
            "device %s: %s round %d failed: %s",
            self.device_id,
            announcement.phase,
            announcement.round_id,
            error,
        )
        self._decline(announcement, f"{announcement.phase} failed: {error}")

    def _decline(self, announcement: RoundAnnouncement, reason: str) -> None:
        """Say "skipped" with the reason: the coordinator stops waiting for this device."""
        self.publish_status(
            "skipped", round_id=announcement.round_id, run_id=announcement.run_id, detail=reason
        )

    def _train(
        self, announcement: RoundAnnouncement, update: LocalUpdate, ctx: LocalContext
    ) -> None:
        def answer(trained: LocalResult) -> None:
            self._reply_with(announcement, *self.uplink.answer(announcement, trained))
            self.last_loss = trained.train_loss
            logger.info(
                "device %s: round %d trained, loss %.4f",
                self.device_id,
                announcement.round_id,
                trained.train_loss,
            )

        self.trainer.submit(update, ctx, answer, lambda error: self._failed(announcement, error))

    def _evaluate(
        self,
        announcement: RoundAnnouncement,
        model: ReceivedModel,
        update: LocalUpdate,
        ctx: LocalContext,
    ) -> None:
        def global_model() -> nn.Module:  # with this device's own statistics (FedBN)
            self._slots.load(self.model_cache.decode(model, self.contexts.model_layout))
            self._slots.load({name: ctx.personal[name] for name in ctx.split.by_kind})
            return self.workspace

        personalized, global_metric = evaluated(
            update, ctx, self.task, self.data.test, global_model, announcement.round_id
        )
        samples = (len(self.data.test), self.attack.declared_samples(len(self.data.train)))
        metric = self.task.metric_name
        report = evaluation_report(
            announcement, self.device_id, metric, personalized, global_metric, samples
        )
        self._reply_with(announcement, report)

    def _reply_with(
        self, announcement: RoundAnnouncement, message: Message, blob: bytes = b""
    ) -> None:
        """Answer `announcement` (kept, to be sent again if the same work is announced again)."""
        self._reply = (work_key(announcement), message, blob)
        self.egress.send(message, blob, answering=announcement)
