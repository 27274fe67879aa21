"""Fleet metrics from device evaluation reports, and the run directory they are written to."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from coordinator.run.summary import RunSummary
from protocols.atomic import write_atomically
from protocols.messages import EvaluationReport, FleetStatus


def _json_bytes(value: Mapping[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True, indent=2, default=str).encode()


def _tail_count(count: int) -> int:
    return max(1, math.ceil(0.1 * count))


def summarize_evaluations(reports: Sequence[EvaluationReport]) -> dict[str, float | None]:
    """Self-FL's fleet metrics (spec selffl.md 5.10) over per-device held-out results.

    personalized_mean: unweighted mean over devices of their personalized model's metric.
    personalized_worst10: unweighted mean over the worst ceil(10%) devices (lowest accuracy,
        highest MSE).
    personalized_top10_weighted: test-sample-weighted mean over the ceil(10%) devices with the
        most training samples.
    global: unweighted mean over devices of the global model's metric (None if the algorithm has
        no global model).
    """
    usable = [r for r in reports if r.num_test_samples > 0]
    if not usable:
        return {
            "personalized_mean": None,
            "personalized_worst10": None,
            "personalized_top10_weighted": None,
            "global": None,
        }
    higher_is_better = usable[0].metric_name == "accuracy"
    values = sorted((r.personalized for r in usable), reverse=not higher_is_better)
    tail = _tail_count(len(usable))
    largest = sorted(usable, key=lambda r: (-r.num_train_samples, r.device_id))[:tail]
    weight = sum(r.num_test_samples for r in largest)
    globals_ = [r.global_model for r in usable]
    return {
        "personalized_mean": sum(values) / len(values),
        "personalized_worst10": sum(values[:tail]) / tail,
        "personalized_top10_weighted": sum(r.personalized * r.num_test_samples for r in largest)
        / weight,
        "global": None
        if any(g is None for g in globals_)
        else sum(g for g in globals_ if g is not None) / len(globals_),
    }


def personalization_effect(reports: Sequence[EvaluationReport]) -> dict[str, float | int] | None:
    """Per device, did the personalized model beat the non-personalized one on its test split?

    The partial-personalization paper finds personalization hurts some devices (spec §6.6);
    this counts them. None when the algorithm has no non-personalized model to compare with.
    """
    pairs = [(r.personalized, r.global_model) for r in reports if r.global_model is not None]
    if not pairs:
        return None
    higher_is_better = reports[0].metric_name == "accuracy"
    gains = [(p - g) if higher_is_better else (g - p) for p, g in pairs]
    return {
        "devices": len(gains),
        "helped": sum(1 for gain in gains if gain > 0),
        "hurt": sum(1 for gain in gains if gain < 0),
        "mean_gain": sum(gains) / len(gains),
    }


class RunRecorder:
    """A run directory, written as the run goes so a dashboard can follow it.

    `run.json` (the settings) at the start; `metrics.jsonl` one line per round; `fleet.json`
    (the fleet status) after each round; `devices.jsonl` (each device's latest evaluation) after
    each evaluation; `summary.json` at the end. Whole files are replaced atomically.
    """

    def __init__(self, out_dir: Path | None, settings: Mapping[str, Any] | None = None) -> None:
        self.out_dir = out_dir
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "metrics.jsonl").write_text("")
            if settings is not None:
                write_atomically(out_dir / "run.json", _json_bytes(settings))

    def record_round(
        self,
        record: Mapping[str, Any],
        reports: Sequence[EvaluationReport] = (),
        fleet: FleetStatus | None = None,
    ) -> None:
        """Append one round's metrics; keep the evaluations and fleet status that came with it."""
        if self.out_dir is None:
            return
        with (self.out_dir / "metrics.jsonl").open("a") as handle:
            handle.write(json.dumps(record, sort_keys=True) + "\n")
        if reports:
            self.write_devices(reports)
        if fleet is not None:
            data = fleet.model_dump_json(exclude={"protocol_version", "kind"}).encode()
            write_atomically(self.out_dir / "fleet.json", data)

    def write_devices(self, reports: Sequence[EvaluationReport]) -> None:
        """Write each device's latest evaluation (`devices.jsonl`), for per-device analysis."""
        if self.out_dir is None:
            return
        lines = [
            report.model_dump_json(exclude={"protocol_version", "sent_at", "kind"})
            for report in reports
        ]
        write_atomically(self.out_dir / "devices.jsonl", "".join(f"{x}\n" for x in lines).encode())

    def write_summary(self, summary: RunSummary) -> None:
        """Write the run's summary."""
        if self.out_dir is None:
            return
        summary.write(self.out_dir)
