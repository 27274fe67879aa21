"""The device agent: hears rounds, trains with its algorithm's local update, reports deltas.

It does the I/O around the math: decoding, personal state load/save, seeds, status and errors.
The same object serves a real device over MQTT and a virtual device in simulation; handlers run
one at a time on the transport's dispatch thread.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from device_agent.algorithms import build_local_update
from device_agent.algorithms.base import LocalContext, LocalUpdate, is_relay, relay_update
from device_agent.capabilities import probe_capabilities
from device_agent.eligibility import EligibilityPolicy
from device_agent.exporting import answer_export_command, export_device_model
from device_agent.memory_plan import MemoryModel, for_split, memory_model, plan_training
from device_agent.received import ReceivedFrames
from device_agent.state_store import StateStore
from device_agent.training import ModelSlots, StepBudget, evaluate, require_finite
from pfl_tasks.base import DeviceData, Task
from pfl_tasks.split import ParamSplit, resolve_split
from protocols import topics
from protocols.algorithms import AlgorithmConfig, parse_algorithm_config
from protocols.codec import (
    Tensors,
    decode_frame,
    describe_tensors,
    encode_frame,
    model_digest,
    pack_tensors,
    split_owners,
    unpack_tensors,
)
from protocols.errors import (
    MemoryBudgetError,
    PflError,
    ProtocolError,
    RoundError,
    StateError,
    TrainingError,
)
from protocols.messages import (
    AnyMessage,
    Capabilities,
    Command,
    DeviceHello,
    DeviceStatus,
    DeviceUpdate,
    EvaluationReport,
    ExportReport,
    MemoryPlan,
    PeerModels,
    PeerRequest,
    RoundAnnouncement,
    SharedModel,
    TensorSpec,
)
from protocols.transport.base import Transport, Will

logger = logging.getLogger(__name__)
STATE_PREFIX = "state:"
"""Stored names of algorithm state, apart from the model's own tensor names."""


def device_will(fleet: str, device_id: str) -> Will:
    """The retained "offline" status the broker publishes if the device vanishes."""
    status = DeviceStatus(device_id=device_id, state="offline", detail="connection lost")
    return Will(topics.device(fleet, device_id, "status"), encode_frame(status))


def derive_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed from the run seed and a context, identical in every process."""
    text = "/".join(str(part) for part in (seed, *parts))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


@dataclass(frozen=True)
class _Plan:
    config: AlgorithmConfig
    update: LocalUpdate
    split: ParamSplit
    fingerprint: str


@dataclass
class _ReceivedModel:
    header: SharedModel
    blob: bytes
    decoded: Tensors | None = None


class DecodedModelCache:
    """Broadcast frames and shared models decoded once: virtual devices in one process share one.

    A broadcast reaches every virtual device as the same bytes object, so its parsed header is
    reused by identity; tensors are keyed by the manifest's SHA-256 and the expected layout, so
    equal keys mean equal tensors. Consumers only read them (loading copies).
    """

    def __init__(self) -> None:
        self._key: tuple[str, tuple[TensorSpec, ...]] | None = None
        self._tensors: Tensors = {}
        self._frames: list[tuple[bytes, tuple[AnyMessage, bytes]]] = []

    def frame(self, payload: bytes) -> tuple[AnyMessage, bytes]:
        """`decode_frame(payload)`, parsed once per broadcast payload object."""
        for seen, decoded in self._frames:
            if seen is payload:
                return decoded
        decoded = decode_frame(payload)
        self._frames = [(payload, decoded), *self._frames[:3]]
        return decoded

    def decode(self, model: _ReceivedModel, expected: tuple[TensorSpec, ...]) -> Tensors:
        """The model's tensors, validated against `expected` on first use."""
        key = (model.header.manifest.sha256, expected)
        if key != self._key:
            self._tensors = unpack_tensors(model.header.manifest, model.blob, expected=expected)
            self._key = key
        return self._tensors


class DeviceAgent:
    """One device of the fleet, real or virtual.

    Args:
        workspace: the nn.Module training happens in; virtual devices share one.
        initial_state: the task model's initial tensors, where personal state starts.
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
    ) -> None:
        self.device_id = device_id
        self.fleet = fleet
        self.transport = transport
        self.task = task
        self.data = data
        self.seed = seed
        self.store = store
        self.workspace = workspace
        self._slots = ModelSlots(workspace)
        self.initial_state = initial_state
        # the coordinator sends the whole model: shared tensors and personal starting points
        self._model_layout = describe_tensors(initial_state)
        self.stateful = stateful
        self.budget = budget or StepBudget()
        self.memory_plan = memory_plan
        self.capabilities = capabilities
        self.model_cache = model_cache or DecodedModelCache()
        self.memory_budget_bytes = memory_budget_bytes
        self.eligibility = eligibility or EligibilityPolicy()
        self._memory: MemoryModel | None = None
        if memory_budget_bytes is not None:
            self._plan_memory_at_start(memory_budget_bytes)
        self.last_loss: float | None = None
        self._model: _ReceivedModel | None = None
        self._pending: RoundAnnouncement | None = None
        self._answered: set[tuple[int, str, float]] = set()
        self._reply: tuple[tuple[int, str, str], topics.DeviceTopicKind, bytes] | None = None
        self._plans: dict[tuple[str, str], _Plan] = {}
        self.last_announcement: RoundAnnouncement | None = None  # what export personalizes with
        self._awaiting: tuple[RoundAnnouncement, _ReceivedModel] | None = None
        self.relayed: dict[str, tuple[str, Tensors]] = {}
        """The models last relayed to this device, by owner: (digest, tensors)."""
        self.mixture: dict[str, Tensors] = {}
        """The models of the last evaluation relay: what an export mixes (FedeRiCo)."""
        self.received = ReceivedFrames.for_store(store, device_id)  # kept for offline export

    def _plan_memory_at_start(self, budget_bytes: int) -> None:
        """Measure once, then plan plain training at the default batch for the hello.

        A budget too small for a micro-batch of one is logged now and refused at each round.
        """
        everything_shared = ParamSplit.for_model(self.workspace, ())
        self._memory = memory_model(self.workspace, self.task, self.data.train, everything_shared)
        try:
            self.memory_plan = plan_training(
                self._memory, budget_bytes, AlgorithmConfig.model_fields["batch_size"].default
            )
        except MemoryBudgetError as error:
            logger.error("device %s: %s", self.device_id, error)

    def _step_budget(self, plan: _Plan) -> StepBudget:
        """The micro-batch this round's split and batch size allow under the memory budget.

        Raises:
            MemoryBudgetError: not even a micro-batch of one fits; the round is refused.
        """
        if self._memory is None or self.memory_budget_bytes is None:
            return self.budget
        terms = for_split(
            self._memory,
            self.workspace,
            plan.split,
            momentum=plan.config.momentum > 0,
            relayed_models=plan.config.relayed_models(),
        )
        memory_plan = plan_training(terms, self.memory_budget_bytes, plan.config.batch_size)
        return StepBudget(memory_plan.micro_batch_size)

    def start(self) -> None:
        """Subscribe to the fleet's topics, then say hello."""
        self.transport.subscribe(topics.shared_model(self.fleet), self._on_model)
        self.transport.subscribe(topics.round_announcement(self.fleet), self._on_round)
        self.transport.subscribe(topics.command(self.fleet), self._on_command)
        self.transport.subscribe(topics.command(self.fleet, self.device_id), self._on_command)
        self.transport.subscribe(topics.relay(self.fleet, self.device_id), self._on_relay)
        self.publish_status("online")
        self.say_hello()

    def rejoin(self) -> None:
        """After a reconnect: re-publish liveness (a restarted broker lost it) and say hello."""
        self.publish_status("online")
        self.say_hello()

    def stop(self) -> None:
        """Leave cleanly: retained status "offline", then disconnect."""
        self.publish_status("offline", detail="stopped")
        self.transport.close()

    def say_hello(self) -> None:
        """Announce this device and its capabilities to the coordinator."""
        hello = DeviceHello(
            device_id=self.device_id,
            task=self.task.name,
            num_train_samples=len(self.data.train),
            capabilities=self.capabilities or probe_capabilities(),
            memory_plan=self.memory_plan,
            stateful=self.stateful,
        )
        self._publish("hello", encode_frame(hello))

    def publish_status(self, state: str, *, round_id: int | None = None, detail: str = "") -> None:
        """Retained liveness and progress for `pfl-coord status`."""
        status = DeviceStatus(
            device_id=self.device_id,
            state=state,  # type: ignore[arg-type]
            round_id=round_id,
            last_loss=self.last_loss,
            detail=detail[:1024],
        )
        self.transport.publish(
            topics.device(self.fleet, self.device_id, "status"), encode_frame(status), retain=True
        )

    # -- handlers ---------------------------------------------------------------------------

    def _on_model(self, topic: str, payload: bytes) -> None:
        message, blob = self.model_cache.frame(payload)
        if not isinstance(message, SharedModel):
            msg = f"expected a shared model, got {message.kind}"
            raise ProtocolError(msg, topic=topic)
        received = _ReceivedModel(message, blob)
        # validated on arrival: a corrupt model is dropped and the previous one stays usable
        received.decoded = self.model_cache.decode(received, self._model_layout)
        self._model = received
        self.received.remember_model(message, payload)
        self._serve_pending()

    def _on_round(self, topic: str, payload: bytes) -> None:
        message, _ = self.model_cache.frame(payload)
        if not isinstance(message, RoundAnnouncement):
            msg = f"expected a round announcement, got {message.kind}"
            raise ProtocolError(msg, topic=topic)
        self.last_announcement = message
        self.received.remember_round(message, payload)
        if (
            message.addresses(self.device_id)
            and (message.round_id, message.phase, message.sent_at) not in self._answered
        ):
            self._pending = message
            self._serve_pending()

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
            self._publish("export-report", encode_frame(answer_export_command(self, message)))

    def _serve_pending(self) -> None:
        announcement, model = self._pending, self._model
        if announcement is None or model is None:
            return
        if model.header.manifest.sha256 != announcement.model_sha256:
            return  # the announced model has not arrived yet
        self._pending = None
        self._answered.add((announcement.round_id, announcement.phase, announcement.sent_at))
        key = (announcement.round_id, announcement.phase, announcement.model_sha256)
        if self._reply is not None and self._reply[0] == key:
            # The same work announced again (a retried round or a restarted coordinator):
            # re-send the answer instead of training twice on the same personal state.
            self._publish(self._reply[1], self._reply[2])
            return
        if announcement.phase == "train":
            reason = self.eligibility.reason_to_skip()
            if reason is not None:
                logger.info(
                    "device %s skips round %d: %s", self.device_id, announcement.round_id, reason
                )
                self.publish_status("skipped", round_id=announcement.round_id, detail=reason)
                return
        self._work(announcement, model)

    def _work(
        self,
        announcement: RoundAnnouncement,
        model: _ReceivedModel,
        peer_models: dict[str, Tensors] | None = None,
    ) -> None:
        """Train or evaluate; a relay algorithm first asks for its models (then `_on_relay`)."""
        try:
            if announcement.phase not in ("train", "evaluate"):
                return
            plan = self._plan(announcement)
            if not self.stateful and plan.config.stateful_only:
                msg = (
                    f"{announcement.algorithm} keeps per-device state between rounds: "
                    "run the agent stateful (without --stateless)"
                )
                raise StateError(msg, device_id=self.device_id)
            if peer_models is None and is_relay(plan.update):
                self._request_models(announcement, model)
            elif announcement.phase == "train":
                self._train(announcement, model, peer_models)
            else:
                self._evaluate(announcement, model, peer_models)
        except PflError as error:
            logger.warning(
                "device %s: %s round %d failed: %s",
                self.device_id,
                announcement.phase,
                announcement.round_id,
                error,
            )
            # "skipped": the coordinator stops waiting for an answer that will not come
            detail = f"{announcement.phase} failed: {error}"
            self.publish_status("skipped", round_id=announcement.round_id, detail=detail)

    def _request_models(self, announcement: RoundAnnouncement, model: _ReceivedModel) -> None:
        """Ask the coordinator for the models this round needs, naming the copies held."""
        update, ctx = self._context(announcement, model)
        wanted = relay_update(update).choose_models(ctx, announcement.phase)  # type: ignore[arg-type]
        request = PeerRequest(
            round_id=announcement.round_id,
            phase=announcement.phase,  # type: ignore[arg-type]
            device_id=self.device_id,
            models=wanted,
            cached={o: held[0] for o, held in self.relayed.items() if o in wanted},
        )
        self._awaiting = (announcement, model)
        self._publish("request", encode_frame(request))

    def _on_relay(self, topic: str, payload: bytes) -> None:
        message, blob = decode_frame(payload)
        if not isinstance(message, PeerModels):
            msg = f"expected relayed models, got {message.kind}"
            raise ProtocolError(msg, topic=topic)
        awaiting = self._awaiting
        if awaiting is None or (awaiting[0].round_id, awaiting[0].phase) != (
            message.round_id,
            message.phase,
        ):
            msg = "stale or unexpected relayed models"
            raise RoundError(msg, device_id=self.device_id, round_id=message.round_id)
        self._awaiting = None
        models = self._relayed_models(message, blob)
        self.relayed = {item.owner: (item.digest, models[item.owner]) for item in message.models}
        if message.phase == "evaluate":
            self.load_mixture(models)
            self.received.remember_relayed(models)
        self._work(awaiting[0], awaiting[1], models)

    def _relayed_models(self, message: PeerModels, blob: bytes) -> dict[str, Tensors]:
        """Decode the sent models and take the unchanged ones from the cache, all verified.

        Raises:
            ProtocolError: a malformed frame, a model that does not match its digest, or a
                cached copy the device does not hold.
        """
        sent = [item.owner for item in message.models if item.sent]
        expected = tuple(
            spec.model_copy(update={"name": f"{owner}/{spec.name}"})
            for owner in sent
            for spec in self._model_layout
        )
        received = split_owners(unpack_tensors(message.manifest, blob, expected=expected))
        models: dict[str, Tensors] = {}
        for item in message.models:
            if item.sent:  # verified here; a cached copy was verified when it arrived
                model = received.get(item.owner, {})
                digest = model_digest(model) if model else ""
            else:
                digest, model = self.relayed.get(item.owner, ("", {}))
            if not model or digest != item.digest:
                msg = f"the relayed model of {item.owner} does not match its digest"
                raise ProtocolError(msg, device_id=self.device_id, round_id=message.round_id)
            models[item.owner] = model
        return models

    # -- export (device_agent/exporting.py) --------------------------------------------------

    def export(
        self, out_path: Path, *, quantize: str | None = None, guard: bool = False
    ) -> ExportReport:
        """Write this device's personalized model to `out_path` as a verified ONNX file.

        Failures (no round seen yet, personal state for another architecture, a failed parity
        check) come back as ok=False with the error, so a command is always answered.
        """
        return export_device_model(self, Path(out_path), quantize=quantize, guard=guard)

    def export_context(self) -> tuple[int, LocalUpdate, LocalContext]:
        """The latest shared model's round, and the context of the latest round with it loaded.

        Raises:
            StateError: no round announcement or shared model received yet.
            PflError: the personal state does not fit (StateError) or the model is malformed.
        """
        announcement, model = self.last_announcement, self._model
        if announcement is None or model is None:
            msg = "no round seen yet: a device exports after it has received a round and a model"
            raise StateError(msg, device_id=self.device_id)
        peer_models = self.mixture or {owner: held[1] for owner, held in self.relayed.items()}
        update, ctx = self._context(announcement, model, peer_models)
        # a relay algorithm's models came with its rounds; the shared template never changes
        return (announcement.round_id if is_relay(update) else model.header.round_id), update, ctx

    def latest_round_id(self) -> int:
        """The round of the latest shared model received (0 before any)."""
        return 0 if self._model is None else self._model.header.round_id

    def load_mixture(self, models: dict[str, Tensors]) -> None:
        """Hold `models`, an evaluation's relay, as the mixture an export uses, by owner."""
        self.mixture = dict(models)

    def load_received(self, model_frame: bytes, announcement: RoundAnnouncement) -> None:
        """Take a kept shared-model frame and round as received, without training (offline)."""
        message, blob = decode_frame(model_frame)
        if not isinstance(message, SharedModel):
            msg = f"expected a shared model, got {message.kind}"
            raise ProtocolError(msg)
        self._model = _ReceivedModel(message, blob)
        self.last_announcement = announcement

    # -- work -------------------------------------------------------------------------------

    def _plan(self, announcement: RoundAnnouncement) -> _Plan:
        """The parsed config, its local update and split; the same every round, so cached."""
        key = (announcement.algorithm, json.dumps(announcement.config, sort_keys=True))
        plan = self._plans.get(key)
        if plan is None:
            try:
                config = parse_algorithm_config(announcement.algorithm, announcement.config)
                update = build_local_update(announcement.algorithm)
            except ValueError as error:
                raise ProtocolError(str(error), round_id=announcement.round_id) from None
            split = resolve_split(self.workspace, self.task.personal_patterns, config)
            plan = _Plan(config, update, split, self._fingerprint(split))
            self._plans = {key: plan}
        return plan

    def _context(
        self,
        announcement: RoundAnnouncement,
        model: _ReceivedModel,
        peer_models: dict[str, Tensors] | None = None,
    ) -> tuple[LocalUpdate, LocalContext]:
        plan = self._plan(announcement)
        config, update, split = plan.config, plan.update, plan.split
        if model.decoded is None:  # a model taken as received offline (`pfl-agent export`)
            model.decoded = self.model_cache.decode(model, self._model_layout)
        received = model.decoded
        global_shared = {name: received[name] for name in split.shared}
        personal, state = self._load_personal(plan, received)
        self._slots.load(global_shared)
        self._slots.load(personal)
        generator = torch.Generator().manual_seed(
            derive_seed(self.seed, self.device_id, announcement.round_id, announcement.phase)
        )
        scalars = announcement.assignments.get(self.device_id)
        context = LocalContext(
            model=self.workspace,
            task=self.task,
            data=self.data,
            split=split,
            config=config,
            global_shared=global_shared,
            personal=personal,
            generator=generator,
            budget=self._step_budget(plan),
            assignment=dict(scalars.scalars) if scalars is not None else {},
            state=state,
            device_id=self.device_id,
            peers=announcement.peers,
            peer_models=peer_models or {},
        )
        return update, context

    def _fingerprint(self, split: ParamSplit) -> str:
        layout = ";".join(
            f"{name}:{tuple(self.initial_state[name].shape)}" for name in split.personal
        )
        return hashlib.sha256(f"{self.task.name}|{layout}".encode()).hexdigest()

    def _load_personal(self, plan: _Plan, received: Tensors) -> tuple[Tensors, Tensors]:
        """Stored personal part and algorithm state, else the coordinator's starting point."""
        stored = self.store.load(plan.fingerprint) if self.stateful else None
        if stored is not None:
            personal = {k: v for k, v in stored.items() if not k.startswith(STATE_PREFIX)}
            state = {
                k.removeprefix(STATE_PREFIX): v
                for k, v in stored.items()
                if k.startswith(STATE_PREFIX)
            }
            return personal, state
        return {name: received[name] for name in plan.split.personal}, {}

    def _train(
        self,
        announcement: RoundAnnouncement,
        model: _ReceivedModel,
        peer_models: dict[str, Tensors] | None = None,
    ) -> None:
        update, ctx = self._context(announcement, model, peer_models)
        result = update.run(ctx)
        if self.stateful and (ctx.split.personal or result.state):
            kept = {**result.personal, **{STATE_PREFIX + k: v for k, v in result.state.items()}}
            require_finite(kept, "personal state")
            self.store.save(self._plan(announcement).fingerprint, kept)
        manifest, blob = pack_tensors(result.shared_delta)
        message = DeviceUpdate(
            round_id=announcement.round_id,
            device_id=self.device_id,
            algorithm=announcement.algorithm,
            num_samples=result.num_samples,
            train_loss=result.train_loss,
            scalars=result.scalars,
            manifest=manifest,
        )
        self._reply_with(announcement, "update", encode_frame(message, blob))
        self.last_loss = result.train_loss

    def _evaluate(
        self,
        announcement: RoundAnnouncement,
        model: _ReceivedModel,
        peer_models: dict[str, Tensors] | None = None,
    ) -> None:
        update, ctx = self._context(announcement, model, peer_models)
        global_metric = None
        if is_relay(update):  # a mixture of relayed models; there is no global model
            personalized = evaluate(relay_update(update).deployable(ctx), self.task, self.data.test)
        else:
            update.personalize(ctx)
            personalized = evaluate(ctx.model, self.task, self.data.test)
        if not math.isfinite(personalized):
            msg = (
                f"the personalized model's test {self.task.metric_name} is {personalized} "
                "(diverged training, or an empty test split): nothing to report"
            )
            raise TrainingError(msg, device_id=self.device_id, round_id=announcement.round_id)
        if ctx.split.shared and not is_relay(update):  # shared + personal starting points
            if model.decoded is not None:
                self._slots.load(model.decoded)
            global_metric = evaluate(self.workspace, self.task, self.data.test)
            if not math.isfinite(global_metric):
                logger.warning(
                    "device %s: the global model's test %s is %s: not reported",
                    self.device_id,
                    self.task.metric_name,
                    global_metric,
                )
                global_metric = None
        report = EvaluationReport(
            round_id=announcement.round_id,
            device_id=self.device_id,
            metric_name=self.task.metric_name,
            personalized=personalized,
            global_model=global_metric,
            num_test_samples=len(self.data.test),
            num_train_samples=len(self.data.train),
        )
        self._reply_with(announcement, "evaluation", encode_frame(report))

    def _reply_with(
        self, announcement: RoundAnnouncement, kind: topics.DeviceTopicKind, payload: bytes
    ) -> None:
        key = (announcement.round_id, announcement.phase, announcement.model_sha256)
        self._reply = (key, kind, payload)
        self._publish(kind, payload)

    def _publish(self, kind: topics.DeviceTopicKind, payload: bytes) -> None:
        self.transport.publish(topics.device(self.fleet, self.device_id, kind), payload)
