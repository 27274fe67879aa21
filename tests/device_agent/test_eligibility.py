import os
from pathlib import Path

from coordinator.engine.rounds import EngineSettings
from coordinator.run.settings import SimulationSettings
from device_agent.eligibility import EligibilityPolicy, on_battery
from pfl_tasks.base import PartitionSpec
from pfl_tasks.registry import load_task
from protocols.transport.inprocess import InProcessBroker
from tests.hub_fleet import hub_agent, hub_engine


def _supply(root: Path, name: str, kind: str, online: str | None = None) -> None:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "type").write_text(kind + "\n")
    if online is not None:
        (folder / "online").write_text(online + "\n")


def test_battery_detection_follows_sysfs(tmp_path: Path) -> None:
    assert not on_battery(tmp_path / "absent")  # boards without power_supply count as mains
    laptop = tmp_path / "laptop"
    _supply(laptop, "BAT0", "Battery")
    _supply(laptop, "AC", "Mains", online="0")
    assert on_battery(laptop)
    (laptop / "AC" / "online").write_text("1\n")
    assert not on_battery(laptop)


def test_policies_give_their_reason(monkeypatch) -> None:
    assert EligibilityPolicy().reason_to_skip() is None
    assert "free memory" in (EligibilityPolicy(min_free_memory_bytes=10**18).reason_to_skip() or "")
    monkeypatch.setattr(os, "getloadavg", lambda: (64.0, 64.0, 64.0))
    assert "CPU load" in (EligibilityPolicy(max_load_per_core=2.0).reason_to_skip() or "")
    assert EligibilityPolicy(max_load_per_core=1000.0).reason_to_skip() is None


def test_a_skipping_device_is_reported_and_not_waited_for() -> None:
    # Prepare: two devices, one of which may never train (it needs an impossible amount of RAM)
    settings = SimulationSettings.load(None, task="digits", algorithm="fedavg", devices=2, rounds=1)
    task = load_task("digits")
    broker = InProcessBroker()
    coordinator = hub_engine(
        broker, settings, EngineSettings(task="digits", rounds=1, quorum=0.5, round_timeout_s=3600)
    )
    fleet = task.make_fleet(2, PartitionSpec(), 0)
    for index, policy in enumerate(
        (EligibilityPolicy(), EligibilityPolicy(min_free_memory_bytes=10**18))
    ):
        hub_agent(
            broker, f"dev-{index}", task, fleet[index], will=False, eligibility=policy
        ).start()
    coordinator.start()
    coordinator.wait_for_devices(2, 1.0)
    # Execute: in-process time does not pass, so the round must settle without its deadline
    record = coordinator.run_round()
    # Assert
    assert record.participants == 1
    assert record.skipped == 1
    detail = {r.device_id: r.detail for r in coordinator.registry.records()}
    assert "free memory" in detail["dev-1"]
