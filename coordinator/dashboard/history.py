"""The run so far as one retained message, so a dashboard attaching late sees the whole trend."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from coordinator.engine.round_types import RoundRecord
from protocols import topics
from protocols.codec import encode_frame
from protocols.messages import (
    MAX_RUN_SETTINGS,
    RUN_HISTORY_ROUNDS,
    DeviceResult,
    EvaluationReport,
    RoundSummary,
    RunHistory,
)

if TYPE_CHECKING:
    from coordinator.engine.rounds import Coordinator

SettingValue = str | float | bool | None
MAX_SETTING_CHARS = 256


def flatten_settings(settings: Mapping[str, Any], prefix: str = "") -> dict[str, SettingValue]:
    """Nested run settings as `a.b` keys with scalar values, secrets and oversize values left out.

    What a dashboard shows as "the run's configuration"; lists become comma-joined text.
    """
    flat: dict[str, SettingValue] = {}
    for key, value in sorted(settings.items()):
        name = f"{prefix}{key}"
        if any(secret in key for secret in ("password", "token", "key_file")):
            continue
        if isinstance(value, Mapping):
            flat.update(flatten_settings(value, f"{name}."))
        elif isinstance(value, bool) or value is None:
            flat[name] = value
        elif isinstance(value, int | float):
            flat[name] = float(value) if math.isfinite(value) else str(value)
        elif isinstance(value, list | tuple):
            flat[name] = ", ".join(str(v) for v in value)[:MAX_SETTING_CHARS]
        else:
            flat[name] = str(value)[:MAX_SETTING_CHARS]
    return {k: flat[k] for k in list(flat)[:MAX_RUN_SETTINGS] if len(k) <= 64}


def round_summary(record: Mapping[str, Any]) -> RoundSummary:
    """A metrics.jsonl line (or `RoundRecord.as_json()`) as the history keeps it."""
    evaluation = record.get("evaluation")
    return RoundSummary(
        round_id=record["round_id"],
        selected=record.get("selected", 0),
        participants=record.get("participants", 0),
        skipped=record.get("skipped", 0),
        dropped=record.get("dropped", 0),
        train_loss=record.get("train_loss"),
        bytes_up=record.get("bytes_up", 0),
        bytes_down=record.get("bytes_down", 0),
        wall_seconds=record.get("wall_seconds", 0.0),
        finished_at=record.get("finished_at"),
        scalars={k: v for k, v in record.get("scalars", {}).items() if math.isfinite(v)},
        evaluation=None if evaluation is None else dict(evaluation),
    )


def device_result(report: EvaluationReport) -> DeviceResult:
    """What a device's evaluation says about personalization's gain for it."""
    return DeviceResult(
        device_id=report.device_id,
        round_id=report.round_id,
        metric_name=report.metric_name,
        personalized=report.personalized,
        global_model=report.global_model,
        num_train_samples=report.num_train_samples,
    )


class RunHistoryLog:
    """The coordinator's record of rounds and latest device results, ready to publish."""

    def __init__(self, fleet: str, settings: Mapping[str, Any]) -> None:
        self.fleet = fleet
        self.settings = flatten_settings(settings)
        self.rounds: deque[RoundSummary] = deque(maxlen=RUN_HISTORY_ROUNDS)
        self.devices: dict[str, DeviceResult] = {}

    def add_round(self, record: RoundRecord | Mapping[str, Any]) -> None:
        """One finished round (a record, or a metrics.jsonl line kept from a resumed run)."""
        line = record.as_json() if isinstance(record, RoundRecord) else record
        self.rounds.append(round_summary(line))

    def add_evaluations(self, reports: Iterable[EvaluationReport]) -> None:
        """The devices' latest held-out results (each replaces that device's earlier one)."""
        for report in reports:
            self.devices[report.device_id] = device_result(report)

    def message(self, run_id: str) -> RunHistory:
        """The retained message: settings, the latest rounds, every device's latest result."""
        return RunHistory(
            fleet=self.fleet,
            run_id=run_id,
            settings=self.settings,
            rounds=tuple(self.rounds),
            devices=tuple(self.devices[k] for k in sorted(self.devices)),
        )


def publish_round(
    coordinator: Coordinator,
    history: RunHistoryLog,
    record: RoundRecord | Mapping[str, Any],
    evaluated: Iterable[EvaluationReport],
) -> None:
    """Add a finished round (or its metrics.jsonl line) and its evaluations; retain the history."""
    history.add_round(record)
    history.add_evaluations(evaluated)
    publish_history(coordinator, history)


def publish_history(coordinator: Coordinator, history: RunHistoryLog) -> None:
    """Retain the history on the fleet's history topic (operators may read it, devices not)."""
    message = history.message(coordinator.run_id)
    topic = topics.run_history(coordinator.settings.fleet)
    coordinator.transport.publish(topic, encode_frame(message), retain=True)
