"""What a device's round starts from: the algorithm's plan and the local context it trains in.

A round's context is the received shared model plus this device's personal part (stored when
stateful, else the coordinator's starting point), loaded into the workspace, with a seed derived
from the run, the device and the round, and the micro-batch the memory budget allows. The same
assembly serves training, evaluation and export, so an exported model is the one evaluated.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from device_agent.algorithms import build_local_update
from device_agent.algorithms.base import LocalContext, LocalResult, LocalUpdate
from device_agent.egress import without_counters
from device_agent.memory_plan import MemoryModel, for_split, memory_model, plan_training
from device_agent.privacy import privatize
from device_agent.received import DecodedModelCache, ReceivedModel
from device_agent.state_store import StateStore
from device_agent.training import (
    ModelSlots,
    StepBudget,
    estimate_statistics,
    require_finite,
)
from device_agent.work_limits import WorkLimitError, WorkLimits, WorkMeter, config_problem
from pfl_tasks.base import DeviceData, Task
from pfl_tasks.split import ParamSplit, resolve_split
from protocols.algorithms import AlgorithmConfig, parse_algorithm_config
from protocols.codec import Tensors, describe_tensors
from protocols.compression import clip_encoded, with_error_feedback
from protocols.errors import MemoryBudgetError, ProtocolError, StateError
from protocols.messages import MemoryPlan, RoundAnnouncement
from protocols.privacy import noise_generator

logger = logging.getLogger(__name__)

STATE_PREFIX = "state:"
RESIDUAL_PREFIX = "uplink-residual:"
"""Kept beside the personal state: what compression left out of earlier updates."""
"""Stored names of algorithm state, apart from the model's own tensor names."""


def derive_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed from the run seed and a context, identical in every process."""
    text = "/".join(str(part) for part in (seed, *parts))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


@dataclass(frozen=True)
class Plan:
    """An announced algorithm as this device runs it: config, local update, split, state key."""

    config: AlgorithmConfig
    update: LocalUpdate
    split: ParamSplit
    fingerprint: str


@dataclass(frozen=True)
class LocalDevice:
    """Who a device is, what it trains on and where it keeps its state: what every round reads.

    Args:
        workspace: the nn.Module training happens in; virtual devices share one.
        initial_state: the task model's initial tensors, where personal state starts.
    """

    device_id: str
    task: Task
    data: DeviceData
    seed: int
    store: StateStore
    workspace: nn.Module
    initial_state: Tensors
    stateful: bool


class RoundContexts:
    """Builds each round's `LocalContext` in the device's workspace and keeps what must stay."""

    def __init__(
        self,
        device: LocalDevice,
        *,
        budget: StepBudget,
        model_cache: DecodedModelCache,
        memory_budget_bytes: int | None,
        limits: WorkLimits | None = None,
        reproducible_noise: bool = False,
    ) -> None:
        self.device = device
        # the coordinator sends the whole model: shared tensors and personal starting points
        self.model_layout = describe_tensors(device.initial_state)
        self.budget = budget
        self.model_cache = model_cache
        self.memory_budget_bytes = memory_budget_bytes
        self.limits = limits
        self.reproducible_noise = reproducible_noise
        self._slots = ModelSlots(device.workspace)
        self._memory: MemoryModel | None = None
        # the last announcement planned, its (algorithm, config) key and its plan
        self._last_plan: tuple[RoundAnnouncement, tuple[str, dict[str, Any]], Plan] | None = None

    def plan_memory_at_start(self) -> MemoryPlan | None:
        """Measure once, then plan plain training at the default batch for the hello.

        A budget too small for a micro-batch of one is logged now and refused at each round.
        """
        if self.memory_budget_bytes is None:
            return None
        everything_shared = ParamSplit.for_model(self.device.workspace, ())
        self._memory = memory_model(
            self.device.workspace, self.device.task, self.device.data.train, everything_shared
        )
        try:
            return plan_training(
                self._memory,
                self.memory_budget_bytes,
                AlgorithmConfig.model_fields["batch_size"].default,
            )
        except MemoryBudgetError as error:
            logger.error("device %s: %s", self.device.device_id, error)
            return None

    def plan(self, announcement: RoundAnnouncement) -> Plan:
        """The parsed config, its local update and split; the same every round, so cached.

        Raises:
            ProtocolError: an unknown algorithm or an invalid config.
        """
        last = self._last_plan
        if last is not None and last[0] is announcement:  # asked again in the same round
            return last[2]
        # compared as values, not re-encoded: the same config from the trusted coordinator
        key = (announcement.algorithm, announcement.config)
        if last is not None and last[1] == key:  # a new round of the same algorithm and config
            plan = last[2]
        else:
            try:
                config = parse_algorithm_config(announcement.algorithm, announcement.config)
                update = build_local_update(announcement.algorithm)
            except ValueError as error:
                raise ProtocolError(str(error), round_id=announcement.round_id) from None
            split = resolve_split(self.device.workspace, self.device.task.personal_patterns, config)
            plan = Plan(config, update, split, self.fingerprint(split))
        self._last_plan = (announcement, key, plan)
        return plan

    def plan_work(self, announcement: RoundAnnouncement) -> Plan:
        """`plan`, refused when it is more work than the ceilings or needs state not kept here.

        Raises:
            WorkLimitError: a `*_epochs` or `*_steps` setting above the ceilings.
            StateError: a stateful-only algorithm on a stateless device.
        """
        plan = self.plan(announcement)
        problem = None if self.limits is None else config_problem(announcement.config, self.limits)
        if problem is not None:
            raise WorkLimitError(problem, device_id=self.device.device_id)
        if not self.device.stateful and plan.config.stateful_only:
            msg = (
                f"{announcement.algorithm} keeps per-device state between rounds: "
                "run the agent stateful (without --stateless)"
            )
            raise StateError(msg, device_id=self.device.device_id)
        return plan

    def build(
        self,
        announcement: RoundAnnouncement,
        model: ReceivedModel,
        peer_models: dict[str, Tensors] | None = None,
    ) -> tuple[LocalUpdate, LocalContext]:
        """The round's local update and its context, with the workspace loaded.

        Raises:
            PflError: a malformed model, personal state that does not fit, or no memory.
        """
        plan = self.plan(announcement)
        received = self.model_cache.decode(model, self.model_layout)
        global_shared = {name: received[name] for name in plan.split.shared}
        personal, state = self._load_personal(plan, received, announcement.run_id)
        self._slots.load(global_shared)
        self._slots.load(personal)
        workspace, train = self.device.workspace, self.device.data.train
        # no state kept: its statistics from its own data, not the coordinator's initial ones
        if not self.device.stateful and estimate_statistics(workspace, personal, train):
            live = self._slots.live()
            personal = {name: live[name].clone() for name in personal}
        generator = torch.Generator().manual_seed(
            derive_seed(
                self.device.seed, self.device.device_id, announcement.round_id, announcement.phase
            )
        )
        scalars = announcement.assignments.get(self.device.device_id)
        context = LocalContext(
            model=self.device.workspace,
            task=self.device.task,
            data=self.device.data,
            split=plan.split,
            config=plan.config,
            global_shared=global_shared,
            personal=personal,
            generator=generator,
            budget=self._round_budget(plan),
            assignment=dict(scalars.scalars) if scalars is not None else {},
            state=state,
            device_id=self.device.device_id,
            peers=announcement.peers,
            peer_models=peer_models or {},
            slots=self._slots,
        )
        return plan.update, context

    def privatize(
        self, announcement: RoundAnnouncement, result: LocalResult
    ) -> tuple[LocalResult, float | None]:
        """The round's result as differential privacy lets it leave (unchanged without DP).

        Integer tensors (counters) leave with a zero delta: no clip or noise covers them.
        """
        if announcement.privacy is None:
            return result, None
        seed = self._noise_seed(announcement, "dp")
        private, within = privatize(result, announcement.privacy, noise_generator(seed))
        return replace(private, shared_delta=without_counters(private.shared_delta)), within

    def ring_noise(self, announcement: RoundAnnouncement) -> np.random.Generator:
        """The generator of the round's discrete Gaussian noise (`protocols.discrete_gaussian`).

        Unpredictable (the OS's entropy) unless the run asks for reproducible noise.
        """
        return np.random.default_rng(self._noise_seed(announcement, "dp-ring"))

    def _noise_seed(self, announcement: RoundAnnouncement, purpose: str) -> int | None:
        if not self.reproducible_noise:
            return None
        return derive_seed(self.device.seed, self.device.device_id, announcement.round_id, purpose)

    def compress(self, announcement: RoundAnnouncement, delta: Tensors) -> tuple[Tensors, Tensors]:
        """(what the update carries, the residual to keep) under the round's uplink codec.

        Error feedback: the residual of earlier rounds (kept on stateful devices, none on
        stateless ones) is added before compressing, and what did not make it is kept. Under
        DP what is sent is clipped again, decoded, to the clip norm (what the re-clip takes off
        is dropped, as clipping drops it; the residual stays what the codec left out).
        """
        if not announcement.uplink.lossy:
            return dict(delta), {}
        residual: Tensors = {}
        if self.device.stateful:
            plan = self.plan(announcement)
            stored = self.device.store.load(plan.fingerprint, announcement.run_id) or {}
            residual = {
                k.removeprefix(RESIDUAL_PREFIX): v
                for k, v in stored.items()
                if k.startswith(RESIDUAL_PREFIX)
            }
        generator = torch.Generator().manual_seed(
            derive_seed(self.device.seed, self.device.device_id, announcement.round_id, "uplink")
        )
        encoded, residual = with_error_feedback(delta, residual, announcement.uplink, generator)
        if announcement.privacy is not None:  # DP bounds what is sent, residual included
            layout = describe_tensors(delta)
            clip = announcement.privacy.clip_norm
            encoded = clip_encoded(encoded, layout, announcement.uplink, clip)
        return encoded, residual if self.device.stateful else {}

    def keep(
        self, announcement: RoundAnnouncement, result: LocalResult, residual: Tensors | None = None
    ) -> None:
        """Persist the round's personal part, algorithm state and uplink residual (if stateful).

        Raises:
            TrainingError: a non-finite tensor (the stored state stays as it was).
            StateError: the write failed; the previous state is intact.
        """
        plan = self.plan(announcement)
        residual = residual or {}
        if not self.device.stateful or not (plan.split.personal or result.state or residual):
            return
        kept = {
            **result.personal,
            **{STATE_PREFIX + k: v for k, v in result.state.items()},
            **{RESIDUAL_PREFIX + k: v for k, v in residual.items()},
        }
        require_finite(kept, "personal state")
        self.device.store.save(plan.fingerprint, kept, announcement.run_id)

    def _round_budget(self, plan: Plan) -> StepBudget:
        """The step budget with a fresh meter for this round's ceilings (none without limits)."""
        budget = self._step_budget(plan)
        if self.limits is None and budget.meter is None:
            return budget
        return replace(budget, meter=None if self.limits is None else WorkMeter(self.limits))

    def _step_budget(self, plan: Plan) -> StepBudget:
        """The micro-batch this round's split and batch size allow under the memory budget.

        Raises:
            MemoryBudgetError: not even a micro-batch of one fits; the round is refused.
        """
        if self._memory is None or self.memory_budget_bytes is None:
            return self.budget
        terms = for_split(
            self._memory,
            self.device.workspace,
            plan.split,
            momentum=plan.config.momentum > 0,
            relayed_models=plan.config.relayed_models(),
        )
        memory_plan = plan_training(terms, self.memory_budget_bytes, plan.config.batch_size)
        return StepBudget(memory_plan.micro_batch_size, checkpointing=memory_plan.checkpointing)

    def fingerprint(self, split: ParamSplit) -> str:
        """The key personal state is stored under: the task and the personal tensors' shapes."""
        layout = ";".join(
            f"{name}:{tuple(self.device.initial_state[name].shape)}" for name in split.personal
        )
        return hashlib.sha256(f"{self.device.task.name}|{layout}".encode()).hexdigest()

    def _load_personal(self, plan: Plan, received: Tensors, run_id: str) -> tuple[Tensors, Tensors]:
        """This run's stored personal part and algorithm state, else the coordinator's start."""
        stored = self.device.store.load(plan.fingerprint, run_id) if self.device.stateful else None
        if stored is not None:
            personal = {
                k: v for k, v in stored.items() if not k.startswith((STATE_PREFIX, RESIDUAL_PREFIX))
            }
            state = {
                k.removeprefix(STATE_PREFIX): v
                for k, v in stored.items()
                if k.startswith(STATE_PREFIX)
            }
            return personal, state
        return {name: received[name] for name in plan.split.personal}, {}
