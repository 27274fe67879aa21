"""Virtual devices in worker processes: the same run, whatever the number of workers."""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import SimulationResult, run_simulation
from coordinator.run.simulation_workers import (
    balanced_shares,
    merge_exports,
    threads_per_worker,
    worker_count,
)
from device_agent.compute_threads import MACS_PER_THREAD, available_cores
from protocols.errors import RoundError
from protocols.messages import EvaluationReport
from protocols.transport.inprocess import InProcessBroker
from protocols.transport.process_hub import ProcessHub

pytestmark = pytest.mark.timeout(300)

# every family: plain, partial (stateful and not), prior, uncertainty, relay
ALGORITHMS: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "fedalt": {"personal": ["output.*"]},
    "fedsim": {"personal": ["output.*"], "stateless": True},
    "pfedbred": {},
    "selffl": {},
    "ditto": {},
    "federico": {"algorithm_options": {"neighbours": 2}},
}


def _run(algorithm: str, workers: int, **values: Any) -> SimulationResult:
    settings = SimulationSettings.load(
        None,
        task="synthetic",
        algorithm=algorithm,
        devices=7,  # uneven shares: 3 workers hold 3, 2 and 2 devices
        rounds=3,
        participation=0.6,
        eval_every=1,
        seed=3,
        workers=workers,
        **{**ALGORITHMS[algorithm], **values},
    )
    return run_simulation(settings)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_results_are_bit_identical_for_one_and_three_workers(algorithm: str) -> None:
    # Execute
    alone, spread = _run(algorithm, workers=1), _run(algorithm, workers=3)
    # Assert: the model, every metric of every round and every device's evaluation
    assert alone.agents  # the devices ran here, and then elsewhere
    assert not spread.agents
    assert alone.final_shared.keys() == spread.final_shared.keys()
    for name, tensor in alone.final_shared.items():
        assert torch.equal(tensor, spread.final_shared[name]), name
    assert alone.summary.metrics == spread.summary.metrics
    assert alone.summary.personalization == spread.summary.personalization
    for one, other in zip(alone.records, spread.records, strict=True):
        assert (one.participants, one.selected, one.train_loss) == (
            other.participants,
            other.selected,
            other.train_loss,
        )
        assert (one.scalars, one.evaluation) == (other.scalars, other.evaluation)
    assert [_content(r) for r in alone.reports] == [_content(r) for r in spread.reports]
    # byte counts carry timings (seconds in updates, memory in hellos): equal to a few bytes
    # per message, and a hello more or less per device depending on when devices join
    assert spread.summary.bytes_up == pytest.approx(alone.summary.bytes_up, rel=0.03)
    assert spread.summary.bytes_down == pytest.approx(alone.summary.bytes_down, rel=0.03)


def _content(report: EvaluationReport) -> dict[str, object]:
    return report.model_dump(exclude={"sent_at", "run_id"})  # when, and which run: not what


def test_workers_export_every_device_and_the_summary_adds_them_up(tmp_path: Path) -> None:
    # Execute
    result = _run("fedalt", workers=2, export_dir=tmp_path / "onnx")
    # Assert
    assert result.summary.export is not None
    assert result.summary.export["ok"] == 7
    assert result.summary.export["failed"] == 0
    files = sorted(p.name for p in (tmp_path / "onnx").glob("*.onnx"))
    assert files == [f"dev-{i:04d}.onnx" for i in range(7)]
    assert result.summary.export["total_bytes"] == sum(
        (tmp_path / "onnx" / name).stat().st_size for name in files
    )


def test_a_worker_that_dies_stops_the_run_with_its_exit_code() -> None:
    # Prepare: kill one worker after the first round
    def kill_a_worker(record: object) -> None:
        del record
        children = multiprocessing.active_children()
        if children:
            os.kill(children[0].pid or 0, signal.SIGKILL)

    settings = SimulationSettings.load(
        None, task="synthetic", algorithm="fedavg", devices=6, rounds=4, workers=2
    )
    # Execute / Assert: a clear error, not a hang
    with pytest.raises(
        RoundError, match=r"simulation worker \d stopped unexpectedly \(exit code -9\)"
    ):
        run_simulation(settings, on_round=kill_a_worker)
    assert not multiprocessing.active_children()  # the other one was stopped too


def test_a_caller_hub_must_be_a_process_hub_when_devices_run_in_workers() -> None:
    settings = SimulationSettings.load(None, task="synthetic", devices=4, rounds=1, workers=2)
    with pytest.raises(ValueError, match="ProcessHub"):
        run_simulation(settings, broker=InProcessBroker())
    tap_seen: list[str] = []
    hub = ProcessHub()
    hub.connect("tap").subscribe("pfl/+/device/+/update", lambda t, p: tap_seen.append(t))
    run_simulation(settings, broker=hub)
    assert len(set(tap_seen)) == 4  # a wiretap on the parent's hub sees every device


def test_worker_count_and_threads_never_oversubscribe_the_cores() -> None:
    cores = available_cores()
    assert worker_count(0, 1000) == cores  # default: one per core
    assert worker_count(0, 1) == 1  # never more workers than devices
    assert worker_count(8, 3) == 3
    big_steps = 10 * cores * MACS_PER_THREAD
    for workers in range(1, 2 * cores + 1):
        assert threads_per_worker(workers, big_steps) >= 1
        assert workers * threads_per_worker(workers, big_steps) <= max(cores, workers)
        assert threads_per_worker(workers, 20_000) == 1  # a small MLP's step: one thread
    assert threads_per_worker(1, big_steps) == cores


def test_merged_export_entries_add_up_and_keep_every_failure() -> None:
    parts = [
        {"dir": "x", "ok": 2, "failed": 1, "failures": {"dev-0002": "bad"}, "total_bytes": 10,
         "shipped_global": 1},
        {"dir": "x", "ok": 3, "failed": 0, "failures": {}, "total_bytes": 5, "shipped_global": 0},
    ]  # fmt: skip
    merged = merge_exports(parts)
    assert merged == {
        "dir": "x",
        "ok": 5,
        "failed": 1,
        "failures": {"dev-0002": "bad"},
        "total_bytes": 15,
        "shipped_global": 1,
    }


def test_worker_shares_cover_every_device_once_with_even_work() -> None:
    # Prepare: power-law sizes, as the synthetic fleet has
    work = [int(1000 / (rank + 1)) + 20 for rank in range(97)]
    # Execute
    shares = balanced_shares(work, 3)
    # Assert
    assert sorted(i for share in shares for i in share) == list(range(97))
    loads = [sum(work[i] for i in share) for share in shares]
    assert max(loads) - min(loads) <= max(work)
    round_robin = [sum(work[i::3]) for i in range(3)]
    assert max(loads) - min(loads) < max(round_robin) - min(round_robin)
    assert balanced_shares(work, 3) == shares  # the same fleet, the same split
