import torch

from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from protocols.algorithms import ALGORITHM_CONFIGS
from protocols.codec import decode_frame
from protocols.messages import DeviceUpdate
from protocols.transport.inprocess import InProcessBroker
from tests.wiretap import recorded_into


def _settings(**values: object) -> SimulationSettings:
    base: dict[str, object] = {"task": "digits", "devices": 8, "rounds": 3, "seed": 0}
    base.update(values)
    return SimulationSettings.load(None, workers=1, **base)


def test_a_run_is_deterministic_for_its_seed() -> None:
    # Prepare / Execute
    first = run_simulation(_settings(algorithm="fedavg-ft", participation=0.5))
    second = run_simulation(_settings(algorithm="fedavg-ft", participation=0.5))
    other = run_simulation(_settings(algorithm="fedavg-ft", participation=0.5, seed=1))
    # Assert
    assert first.summary.metrics == second.summary.metrics
    assert [r.train_loss for r in first.records] == [r.train_loss for r in second.records]
    for name, tensor in first.final_shared.items():
        assert torch.equal(tensor, second.final_shared[name]), name
    assert any(
        not torch.equal(tensor, other.final_shared[name])
        for name, tensor in first.final_shared.items()
    )


def test_summary_has_the_documented_keys(tmp_path) -> None:
    import json

    run_simulation(_settings(algorithm="fedavg", out=tmp_path / "run"))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    for key in (
        "algorithm",
        "task",
        "devices",
        "rounds",
        "seed",
        "wall_seconds",
        "bytes_up",
        "bytes_down",
        "metric_name",
    ):
        assert key in summary
    assert set(summary["metrics"]) == {
        "personalized_mean",
        "personalized_worst10",
        "personalized_top10_weighted",
        "global",
    }
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    assert (
        json.loads(lines[-1])["evaluation"]["personalized_mean"]
        == summary["metrics"]["personalized_mean"]
    )


def test_no_update_carries_a_personal_tensor_name_or_bytes() -> None:
    for algorithm, config_type in ALGORITHM_CONFIGS.items():
        if algorithm == "federico":  # whole models, no personal part: see test_federico_fleet
            continue
        # Prepare: a wiretap on the hub sees every payload; personal = the output layer
        personal = ["output.*"] if config_type.default_personal == "none" else None
        broker = InProcessBroker()
        payloads: list[tuple[str, bytes]] = []
        tap = broker.connect("wiretap")
        tap.subscribe("#", recorded_into(payloads))
        # Execute
        result = run_simulation(_settings(algorithm=algorithm, personal=personal), broker=broker)
        # Assert: update manifests name only shared tensors, and carry no personal name at all
        updates = [(decode_frame(p)[0], p) for t, p in payloads if t.endswith("/update")]
        assert updates, algorithm
        for update, payload in updates:
            assert isinstance(update, DeviceUpdate)
            assert all(not spec.name.startswith("output.") for spec in update.manifest.tensors)
            assert b"output." not in payload
        # ... and no device's trained personal tensor appears in any payload, up or down (the
        # coordinator's broadcast holds only the global starting point of personal parts)
        wire = b"".join(p for _, p in payloads)
        for agent in result.agents:
            split = agent_split(agent, algorithm, personal)
            stored = agent.store.load(agent.contexts.fingerprint(split))
            assert stored, (algorithm, agent.device_id)
            for tensor in stored.values():
                assert tensor.numpy().tobytes() not in wire, algorithm


def agent_split(agent, algorithm: str, personal):
    from pfl_tasks.split import resolve_split
    from protocols.algorithms import parse_algorithm_config

    config = parse_algorithm_config(algorithm, {"personal": personal} if personal else {})
    return resolve_split(agent.workspace, agent.task.personal_patterns, config)


def test_byte_counts_are_what_the_devices_moved() -> None:
    result = run_simulation(_settings(algorithm="fedavg"))
    sent, received = result.device_bytes()
    assert result.summary.bytes_up == sent > 0
    assert result.summary.bytes_down == received > 0
    model_bytes = sum(t.numel() * t.element_size() for t in result.final_shared.values())
    first = result.records[0]
    # each of 8 devices received at least the new model and sent at least its delta
    assert first.bytes_down >= 8 * model_bytes
    assert first.bytes_up >= 8 * model_bytes


def test_a_thousand_virtual_devices_share_one_model() -> None:
    result = run_simulation(
        _settings(task="synthetic", algorithm="fedavg", devices=1000, rounds=1, participation=0.05)
    )
    workspaces = {id(agent.workspace) for agent in result.agents}
    assert len(workspaces) == 1
    assert result.records[0].participants == 50
    assert len(result.reports) == 1000


def test_local_training_refuses_stateless_devices() -> None:
    # every tensor is personal: a stateless device would evaluate its untrained initial model
    import pytest

    with pytest.raises(ValueError, match="local keeps per-device state"):
        run_simulation(_settings(algorithm="local", stateless=True))
