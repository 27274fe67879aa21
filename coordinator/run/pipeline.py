"""A run's stages and its round loop, shared by `simulate` and `serve`.

A run may start with non-personalized FedAvg pretraining (`--pretrain-rounds`), after which the
chosen algorithm takes over with its personal parameters warm-started from the pretrained model,
as the partial-personalization spec's pipeline does (§3.1 a-b; stage c, the final personal
fine-tuning, happens on the devices when they evaluate or export).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from coordinator.engine.metrics import personalization_effect
from coordinator.engine.registry import FleetRegistry
from coordinator.engine.rounds import Coordinator, RoundRecord
from coordinator.engine.run_state import all_skipped
from coordinator.run.settings import RunSettings
from coordinator.run.summary import RunSummary
from coordinator.scheduling.asynchronous import BufferedRounds
from coordinator.stages.compatibility import check
from coordinator.stages.privacy import PrivacyEngine
from coordinator.stages.privacy_stage import PrivacyStage
from coordinator.stages.secure.aggregator import SecureAggregator
from coordinator.stages.secure.uplink import SecureUplink
from coordinator.stages.uplink import PlainUplink, UplinkPath
from coordinator.strategies import build_strategy
from coordinator.tier.settings import TierSettings
from coordinator.tier.uplink import tier_uplink
from pfl_tasks.base import Task
from pfl_tasks.split import resolve_split
from protocols import topics
from protocols.algorithms import AlgorithmConfig, parse_algorithm_config
from protocols.codec import Tensors
from protocols.messages import EvaluationReport
from protocols.offences import Offences
from protocols.secure_aggregation import SecureAggregationSettings

RoundCallback = Callable[[RoundRecord], None]


@dataclass
class RunResult:
    """A run's summary (as in summary.json), round records, final device reports and model."""

    summary: RunSummary
    records: list[RoundRecord] = field(default_factory=list)
    reports: list[EvaluationReport] = field(default_factory=list)
    final_shared: Tensors = field(default_factory=dict)


logger = logging.getLogger(__name__)
_COMMON_FIELDS = (
    "local_epochs",
    "batch_size",
    "lr",
    "max_steps",
    "momentum",
    "weight_decay",
    "norm_stats",
)


@dataclass(frozen=True)
class Stage:
    """Rounds up to `last_round` train with `config`, sharing `shared_names`."""

    config: AlgorithmConfig
    shared_names: tuple[str, ...]
    last_round: int


@dataclass(frozen=True)
class Stages:
    """The run's stages in order, and the participation every stage samples with."""

    stages: tuple[Stage, ...]
    participation: float
    secure: SecureAggregationSettings | None = None
    """Secure aggregation of every stage's rounds (None: plain updates)."""
    tier: TierSettings | None = None
    """Partial aggregates from an aggregator tier (None: the coordinator reads each update)."""

    @property
    def total_rounds(self) -> int:
        """Rounds over all stages."""
        return self.stages[-1].last_round

    @property
    def final(self) -> Stage:
        """The stage whose model the devices finally personalize and deploy."""
        return self.stages[-1]

    def at(self, round_id: int) -> Stage:
        """The stage round `round_id` (1-based) belongs to."""
        for stage in self.stages:
            if round_id <= stage.last_round:
                return stage
        return self.final

    def enter(self, coordinator: Coordinator, round_id: int) -> None:
        """Make sure the coordinator runs round `round_id` with its stage's strategy."""
        stage = self.at(round_id)
        if coordinator.strategy.config != stage.config:
            strategy = build_strategy(stage.config, self.participation)
            coordinator.switch_strategy(strategy, stage.shared_names)


def plan_stages(settings: RunSettings, task: Task, model: nn.Module) -> Stages:
    """Pretraining (if asked) then the chosen algorithm.

    Raises:
        ValueError: an unknown algorithm, invalid hyperparameters, or features that do not
            compose with each other or with the algorithm (`coordinator.stages.compatibility`).
    """
    config = settings.algorithm_config()
    split = resolve_split(model, task.personal_patterns, config)
    stages = []
    if settings.pretrain_rounds:
        common = {key: getattr(config, key) for key in _COMMON_FIELDS}
        pretrain = parse_algorithm_config("fedavg", common)
        shared = resolve_split(model, task.personal_patterns, pretrain).shared
        stages.append(Stage(pretrain, shared, settings.pretrain_rounds))
    stages.append(Stage(config, split.shared, settings.pretrain_rounds + settings.rounds))
    check(settings, [stage.config for stage in stages], model)
    privacy = settings.privacy()
    poisson = privacy is not None and privacy.sampling == "poisson"
    # Poisson cohorts are drawn by the PrivacyEngine at rate --participation, and the strategy
    # takes everyone it is given (the declared resolution of "participation < 1" with DP)
    participation = 1.0 if poisson else settings.participation
    return Stages(
        tuple(stages), participation, settings.secure_aggregation(), settings.tier_settings()
    )


def build_coordinator(
    connect_coordinator: Callable[[], Any],
    stages: Stages,
    model: nn.Module,
    engine_settings: Any,
    task: Task | None = None,
    privacy: PrivacyEngine | None = None,
    offences: Offences | None = None,
) -> Coordinator:
    """A coordinator holding `model`'s initial tensors, set up for the first stage.

    With `task`, a relay algorithm (FedeRiCo) starts each device's model from the task's own
    initialization with a per-device seed; with `privacy`, rounds are differentially private;
    `offences` counts each device's dropped messages (the transport's too, when it shares it).
    """
    first = stages.stages[0]
    tensors = {name: value.detach().clone() for name, value in model.state_dict().items()}
    transport = connect_coordinator()
    offences = Offences() if offences is None else offences
    uplink: UplinkPath = PlainUplink()
    if stages.tier is not None:  # with secure aggregation, each aggregator runs it in its group
        uplink = tier_uplink(stages.tier, transport, engine_settings.fleet, stages.secure)
    elif stages.secure is not None:
        fleet = engine_settings.fleet

        def blame(device_id: str, reason: str) -> None:
            offences.record(device_id, topics.device(fleet, device_id, "secagg"), reason)

        uplink = SecureUplink(SecureAggregator(stages.secure, transport, fleet, blame))
    # under DP or secure aggregation no device's loss is shown (a hostile or older device may
    # still send one): the fleet status every device reads must not republish it
    registry = FleetRegistry(keeps_losses=privacy is None and uplink.shows_losses)
    coordinator = Coordinator(
        transport,
        build_strategy(first.config, stages.participation),
        tensors,
        engine_settings,
        shared_names=first.shared_names,
        build_model=None if task is None else model_builder(task),
        stages=() if privacy is None else (PrivacyStage(privacy),),
        uplink=uplink,
        offences=offences,
        registry=registry,
    )
    coordinator.transport.on_reconnect(coordinator.republish)  # a restarted broker forgot us
    return coordinator


def privacy_of(coordinator: Coordinator) -> PrivacyEngine | None:
    """The run's differential privacy engine, if its rounds have one."""
    found = [s.engine for s in coordinator.stages if isinstance(s, PrivacyStage)]
    return found[0] if found else None


def model_builder(task: Task) -> Callable[[int], Tensors]:
    """The tensors of `task.build_model(seed)`, for a relay strategy's per-device models."""

    def build(seed: int) -> Tensors:
        return {k: v.detach().clone() for k, v in task.build_model(seed).state_dict().items()}

    return build


def drive_rounds(
    coordinator: Coordinator,
    stages: Stages,
    *,
    run_round: Callable[[], RoundRecord],
    after_round: Callable[[RoundRecord, Sequence[EvaluationReport]], None],
    scheduler: BufferedRounds | None = None,
) -> tuple[list[RoundRecord], list[EvaluationReport]]:
    """Run the remaining rounds of every stage with periodic and final evaluation, then finish.

    `run_round` runs one training round (a caller may add retries); `after_round` sees each
    finished record with the device evaluations made after it, if any (metrics, checkpoints,
    dashboards, progress). A `scheduler` that collects on its own stops before the
    coordinator says "finished".
    """
    eval_every = coordinator.settings.eval_every
    records: list[RoundRecord] = []
    reports: list[EvaluationReport] = []
    total = stages.total_rounds
    stopped = False
    while coordinator.round_id < total:
        if out_of_budget(coordinator):
            stopped = True
            break
        stages.enter(coordinator, coordinator.round_id + 1)
        dropped_before = coordinator.offences.total()
        record = run_round()
        record.dropped = coordinator.offences.total() - dropped_before
        round_id = record.round_id
        evaluated: list[EvaluationReport] = []
        if eval_every and round_id % eval_every == 0 and round_id < total:
            evaluated, record.evaluation = coordinator.evaluate()
        if round_id == total:
            reports, record.evaluation = coordinator.evaluate(final=True)
            evaluated = reports
        after_round(record, evaluated)
        records.append(record)
    if not records or stopped:
        # resumed after the last round, or stopped at the privacy budget: evaluate now
        stages.enter(coordinator, max(coordinator.round_id, 1))
        reports, evaluation = coordinator.evaluate(final=True)
        if records:
            records[-1].evaluation = evaluation
    if scheduler is not None:
        scheduler.close()
    coordinator.run_state.finish(all_skipped(records))
    return records, reports


def out_of_budget(coordinator: Coordinator) -> bool:
    """Whether DP's budget stops the run before its next round (a warning when it only warns)."""
    privacy = privacy_of(coordinator)
    if privacy is None:
        return False
    reason = privacy.over_budget(coordinator.registry.online_count())
    if not reason:
        return False
    if privacy.settings.on_budget == "warn":
        logger.warning("round %d: %s; going on (on budget: warn)", coordinator.round_id + 1, reason)
        return False
    logger.warning("stopping after round %d: %s", coordinator.round_id, reason)
    spent, budget = privacy.epsilon, privacy.settings.target_epsilon or 0.0
    coordinator.run_state.stopping(
        f"stopped after round {coordinator.round_id} of {coordinator.settings.rounds}: another "
        f"round would pass the privacy budget (epsilon {spent:.2f} of {budget:.2f} spent)"
    )
    return True


def summarize_run(
    coordinator: Coordinator,
    stages: Stages,
    settings: RunSettings,
    records: list[RoundRecord],
    reports: list[EvaluationReport],
    *,
    devices: int,
    traffic: tuple[int, int],
    started: float,
) -> RunSummary:
    """The summary of a finished run: what it trained, its final metrics and its cost.

    `traffic` is (bytes up, bytes down) as the caller measured them; `started` is the run's
    `time.perf_counter()` at its start.
    """
    config = stages.final.config
    privacy = privacy_of(coordinator)
    return RunSummary(
        algorithm=config.name,
        task=coordinator.settings.task,
        metric_name=coordinator.settings.metric,
        devices=devices,
        rounds=coordinator.round_id,
        pretrain_rounds=settings.pretrain_rounds,
        seed=settings.seed,
        participation=settings.participation,
        metrics=records[-1].evaluation if records else None,
        personalization=personalization_effect(reports),
        wall_seconds=time.perf_counter() - started,
        bytes_up=traffic[0],
        bytes_down=traffic[1],
        rejected_messages=coordinator.rejected,
        config=config.model_dump(mode="json"),
        privacy=None if privacy is None else privacy.report(),
        stop_reason=coordinator.run_state.stop_reason or None,
    )
