"""Asynchronous buffered aggregation and rounds on a simulated clock, through real simulations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.engine.rounds import Coordinator
from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import SimulationResult, run_simulation
from coordinator.scheduling.asynchronous import BufferedRounds
from coordinator.scheduling.dispatch import DispatchInbox
from coordinator.strategies.base import ReceivedUpdate
from tests.run_metrics import fleet_metric

pytestmark = pytest.mark.slow
SMALL: dict[str, Any] = {"task": "digits", "devices": 8, "rounds": 3, "seed": 3, "workers": 1}


def _run(**values: Any) -> SimulationResult:
    return run_simulation(SimulationSettings.load(None, **{**SMALL, **values}))


def _same_model(a: SimulationResult, b: SimulationResult) -> bool:
    return a.final_shared.keys() == b.final_shared.keys() and all(
        torch.equal(a.final_shared[k], b.final_shared[k]) for k in a.final_shared
    )


@pytest.mark.parametrize(("algorithm", "extra"), [("fedavg", {}), ("fedalt", {"local_epochs": 2})])
def test_async_with_the_whole_cohort_as_buffer_and_no_staleness_equals_sync(
    algorithm: str, extra: dict[str, Any]
) -> None:
    synchronous = _run(algorithm=algorithm, **extra)
    asynchronous = _run(
        algorithm=algorithm, mode="async", buffer=8, concurrency=8, max_staleness=0, **extra
    )
    assert _same_model(synchronous, asynchronous)
    assert asynchronous.summary.metrics == synchronous.summary.metrics
    assert [r.train_loss for r in asynchronous.records] == [
        r.train_loss for r in synchronous.records
    ]
    assert [r.scalars["staleness_max"] for r in asynchronous.records] == [0.0, 0.0, 0.0]
    assert asynchronous.summary.sim_seconds is not None


def test_each_buffered_update_is_its_delta_times_the_staleness_weight(monkeypatch) -> None:
    # Prepare: spy on what devices sent and on what the strategy was given
    raw: dict[tuple[str, int], ReceivedUpdate] = {}
    landed: list[tuple[str, int, int]] = []  # device, round asked for, round applied to
    applied: dict[int, list[ReceivedUpdate]] = {}
    offer, land, apply = DispatchInbox.offer, BufferedRounds._land, Coordinator.apply_updates

    def spy_offer(self: DispatchInbox, device_id: str, answer: ReceivedUpdate) -> bool:
        raw[(device_id, self.rounds[device_id])] = answer
        return offer(self, device_id, answer)

    def spy_land(self: BufferedRounds, device_id: str, dispatch: Any, *args: Any) -> None:
        if self.inbox.landed(device_id) and device_id not in self.inbox.declined:
            landed.append((device_id, dispatch.round_id, self.coordinator.round_id + 1))
        land(self, device_id, dispatch, *args)

    def spy_apply(self: Coordinator, round_id: int, updates: Any) -> Any:
        applied[round_id] = list(updates)
        return apply(self, round_id, updates)

    monkeypatch.setattr(DispatchInbox, "offer", spy_offer)
    monkeypatch.setattr(BufferedRounds, "_land", spy_land)
    monkeypatch.setattr(Coordinator, "apply_updates", spy_apply)
    # Execute: small buffers, many devices at once and a 10x speed spread make stale updates
    # (the fair share, which weighs fast devices down too, is off: this is the staleness rule)
    result = _run(
        mode="async", devices=12, rounds=6, buffer=2, concurrency=10, max_staleness=3,
        staleness="poly:0.5", sim_speeds="lognormal:10", fair_share=0,
    )  # fmt: skip
    # Assert
    kept = dropped = 0
    for device_id, asked_for, applied_to in landed:
        staleness = applied_to - asked_for
        scaled = {u.device_id: u for u in applied.get(applied_to, [])}
        if staleness > 3:
            dropped += 1
            assert device_id not in scaled or scaled[device_id] is not raw[(device_id, asked_for)]
            continue
        kept += 1
        weight = (1 + staleness) ** -0.5
        sent = raw[(device_id, asked_for)].shared_delta
        for name, tensor in scaled[device_id].shared_delta.items():
            assert torch.allclose(tensor, sent[name] * weight, rtol=0, atol=1e-7), name
    assert (
        kept == sum(len(v) for v in applied.values()) == sum(r.participants for r in result.records)
    )
    assert dropped == sum(r.scalars["stale_dropped"] for r in result.records) > 0
    assert max(r.scalars["staleness_max"] for r in result.records) == 3


def test_results_do_not_depend_on_the_number_of_workers() -> None:
    values = {
        "mode": "async", "devices": 12, "buffer": 3, "concurrency": 6, "rounds": 4,
        "sim_speeds": "lognormal:10", "sim_availability": "diurnal:0.7:60",
    }  # fmt: skip
    one, two = _run(**values, workers=1), _run(**values, workers=2)
    assert _same_model(one, two)
    assert one.summary.metrics == two.summary.metrics
    assert [r.sim_seconds for r in one.records] == [r.sim_seconds for r in two.records]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_half_the_fleet_vanishing_mid_round_loses_no_accepted_update(
    mode: str, tmp_path: Path
) -> None:
    # Prepare: devices 0-3 stay; devices 4-7 leave 1.5 s in, before any job (>= 2 s) ends
    trace = tmp_path / "sessions.csv"
    rows = [f"dev-{i:04d},0,{1e6 if i < 4 else 1.5}" for i in range(8)]
    trace.write_text("device,start_s,end_s\n" + "\n".join(rows) + "\n")
    values: dict[str, Any] = {"sim_availability": f"trace:{trace}", "rounds": 2}
    if mode == "async":
        values.update(mode="async", buffer=4, concurrency=8, max_staleness=0)
    # Execute
    result = _run(**values)
    first = result.records[0]
    # Assert: the four stayers' updates made the first aggregation, the leavers' work is lost
    assert (first.participants, first.selected, first.scalars["lost"]) == (4, 8, 4.0)
    assert result.records[1].participants == 4
    stayers_only = _run(
        sim_availability=f"trace:{trace}", rounds=2, **({} if mode == "sync" else {
            "mode": "async", "buffer": 4, "concurrency": 4, "max_staleness": 0})
    )  # fmt: skip
    assert _same_model(result, stayers_only)


def test_a_sync_deadline_drops_the_late_devices_updates_and_bounds_the_round() -> None:
    result = _run(sim_speeds="lognormal:10", sim_deadline=3.0, rounds=2)
    for record in result.records:
        assert record.scalars["late"] > 0
        assert record.participants + record.scalars["late"] == record.selected
    assert result.records[0].sim_seconds == pytest.approx(3.0)
    assert result.records[1].sim_seconds == pytest.approx(6.0)


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"algorithm": "pfedme"}, "pfedme needs synchronous rounds"),
        ({"algorithm": "pfedbred"}, "global step"),
        ({"algorithm": "selffl"}, "fleet variance"),
        ({"algorithm": "federico"}, "relayed"),
        ({"algorithm": "local"}, "aggregates nothing"),
        ({"dp_noise": 1.0, "dp_sampling": "poisson"}, "dp-sampling poisson"),
        ({"secagg": True}, "secure aggregation"),
        ({"algorithm": "fedalt", "pretrain_rounds": 2}, "pretrain"),
        ({"compress_down": "int8"}, "compress-down"),
    ],
)
def test_what_needs_synchronous_rounds_is_refused_with_the_reason(
    values: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        _run(mode="async", **values)


def test_async_keeps_working_with_compressed_updates_and_stateless_devices() -> None:
    result = _run(mode="async", algorithm="fedsim", buffer=3, compress="int8", stateless=True)
    assert result.summary.metrics is not None
    assert fleet_metric(result.summary) > 0.3
    assert all(r.participants == 3 for r in result.records)


def test_the_inbox_takes_only_the_open_job_of_each_device_and_only_once() -> None:
    inbox = DispatchInbox()
    update = ReceivedUpdate("dev-1", 3, 0.1, {"w": torch.zeros(1)})
    inbox.dispatch("dev-1", 4)
    assert not inbox.asks("dev-1", 3)  # an older job's answer is a replay
    assert not inbox.asks("dev-2", 4)  # a device not asked
    assert inbox.asks("dev-1", 4)
    assert inbox.offer("dev-1", update)
    assert not inbox.asks("dev-1", 4)  # answered: a second copy is refused
    assert not inbox.offer("dev-1", update)
    assert inbox.arrivals() == ["dev-1"]
    assert inbox.settle("dev-1") == (update, False)
    assert not inbox.asks("dev-1", 4)  # settled: nothing open any more
    inbox.dispatch("dev-1", 5)
    inbox.decline("dev-1")
    assert inbox.landed("dev-1")
    assert inbox.settle("dev-1") == (None, True)


def test_async_over_the_embedded_mqtt_broker_from_the_command_line(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    command = [
        sys.executable, "-m", "coordinator.cli.app", "simulate", "--transport", "mqtt",
        "--devices", "4", "--rounds", "3", "--mode", "async", "--buffer", "2",
        "--concurrency", "3", "--sim-speeds", "lognormal:5", "--out", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rounds"] == 3
    assert summary["sim_seconds"] > 0
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["participants"] for line in lines] == [2, 2, 2]


def test_devices_whose_jobs_were_lost_work_on_the_same_version_once_back(tmp_path: Path) -> None:
    # Prepare: every device leaves before its first job ends and comes back at 100 s
    trace = tmp_path / "sessions.csv"
    rows = [f"dev-{i:04d},{start},{end}" for i in range(4) for start, end in ((0, 1.5), (100, 1e6))]
    trace.write_text("device,start_s,end_s\n" + "\n".join(rows) + "\n")
    # Execute
    result = _run(
        mode="async", devices=4, buffer=4, concurrency=4, rounds=1,
        sim_availability=f"trace:{trace}",
    )  # fmt: skip
    # Assert: the lost jobs are counted, then the same version is trained once they are back
    (record,) = result.records
    assert (record.participants, record.scalars["lost"], record.selected) == (4, 4.0, 8)
    assert record.sim_seconds is not None
    assert record.sim_seconds > 100.0


def test_in_real_time_an_aggregation_takes_k_updates_even_when_more_arrive_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Prepare: real-time buffered rounds (as `serve` runs them) over the in-process hub, and a
    # coordinator that wakes only once three answers are in, as one busy aggregating would
    import coordinator.run.simulate as simulate_module

    def real_time(coordinator: Coordinator, settings: Any, clock: Any) -> BufferedRounds:
        return BufferedRounds(coordinator, settings.async_settings(), None, 1.0)

    def three_at_once(self: DispatchInbox) -> bool:
        with self._lock:
            return len(self._arrivals) >= 3

    monkeypatch.setattr(simulate_module, "buffered_rounds", real_time)
    monkeypatch.setattr(DispatchInbox, "has_arrivals", three_at_once)
    # Execute
    result = _run(mode="async", devices=4, buffer=2, concurrency=4, rounds=4, max_staleness=4)
    # Assert: K updates an aggregation; those beyond it count in the next one, a version stale
    assert [r.participants for r in result.records] == [2, 2, 2, 2]
    assert result.records[1].scalars["staleness_max"] == 1.0
    assert result.records[-1].sim_seconds is None  # real time
