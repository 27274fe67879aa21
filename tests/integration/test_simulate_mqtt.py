import pytest
import torch

from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation


def _settings(**values: object) -> SimulationSettings:
    base: dict[str, object] = {
        "task": "digits",
        "algorithm": "fedavg-ft",
        "devices": 4,
        "rounds": 2,
        "seed": 3,
    }
    base.update(values)
    return SimulationSettings.load(None, workers=1, **base)


@pytest.mark.mosquitto
def test_virtual_devices_over_mosquitto_match_the_in_process_run(mosquitto) -> None:
    # Execute
    hub = run_simulation(_settings())
    wire = run_simulation(_settings(transport="mqtt", broker=mosquitto.url))
    # Assert: same model, same metrics; the bytes are real MQTT payloads
    for name, tensor in hub.final_shared.items():
        assert torch.equal(tensor, wire.final_shared[name]), name
    assert wire.summary.metrics == hub.summary.metrics
    assert wire.summary.bytes_up > 0
    assert abs(wire.summary.bytes_down - hub.summary.bytes_down) < 0.01 * hub.summary.bytes_down


def test_without_a_broker_simulate_mqtt_serves_an_embedded_one() -> None:
    hub = run_simulation(_settings(devices=3, rounds=1))
    wire = run_simulation(_settings(devices=3, rounds=1, transport="mqtt"))
    assert wire.summary.metrics == hub.summary.metrics


@pytest.mark.mosquitto
@pytest.mark.parametrize(
    ("task", "algorithm"), [("gaussian", "selffl"), ("digits", "pfedbred"), ("digits", "fedalt")]
)
def test_algorithms_with_scalars_and_device_state_match_over_mosquitto(
    mosquitto, task: str, algorithm: str
) -> None:
    # Self-FL sends sigma_m^2 up and S_-m down; pFedBreD and FedAlt keep state on the device
    hub = run_simulation(_settings(task=task, algorithm=algorithm, rounds=3))
    wire = run_simulation(
        _settings(task=task, algorithm=algorithm, rounds=3, transport="mqtt", broker=mosquitto.url)
    )
    for name, tensor in hub.final_shared.items():
        assert torch.equal(tensor, wire.final_shared[name]), name
    assert wire.summary.metrics == hub.summary.metrics
    assert [r.scalars for r in wire.records] == [r.scalars for r in hub.records]


@pytest.mark.mosquitto
def test_federico_relay_over_mosquitto_matches_the_in_process_run(mosquitto) -> None:
    # FedeRiCo's requests and relayed models travel on their own topics: same models, same
    # metrics, same fleet scalars as the in-process hub
    values = {"task": "sine", "algorithm": "federico", "devices": 5, "rounds": 4, "lr": 0.03}
    hub = run_simulation(_settings(**values))
    wire = run_simulation(_settings(**values, transport="mqtt", broker=mosquitto.url))
    assert wire.summary.metrics == hub.summary.metrics
    assert [r.scalars for r in wire.records] == [r.scalars for r in hub.records]
    for at_hub, over_wire in zip(hub.agents, wire.agents, strict=True):
        assert at_hub.relay.relayed.keys() == over_wire.relay.relayed.keys()
        for owner, (digest, _) in at_hub.relay.relayed.items():
            assert over_wire.relay.relayed[owner][0] == digest, owner
