"""Evaluation reports outside their metric's range are dropped, counted, and change no summary."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from coordinator.engine.intake import check_evaluation
from protocols import topics
from protocols.errors import ProtocolError
from protocols.messages import EvaluationReport, RoundAnnouncement
from protocols.transport.base import Transport
from protocols.transport.inprocess import InProcessBroker
from tests.hub_fleet import hub_agents, hub_coordinator, hub_impostor

HONEST = ["dev-0", "dev-1", "dev-2"]
RUN = "0" * 32


def _report(
    metric: str, personalized: float, global_model: float | None = None
) -> EvaluationReport:
    return EvaluationReport(
        run_id=RUN,
        round_id=1,
        device_id="liar",
        metric_name=metric,  # type: ignore[arg-type]
        personalized=personalized,
        global_model=global_model,
        num_test_samples=10,
        num_train_samples=10,
    )


@pytest.mark.parametrize(
    ("report", "metric", "complaint"),
    [
        (_report("mse", 0.5), "accuracy", "reports mse, the fleet's task measures accuracy"),
        (_report("accuracy", 0.5), "mse", "reports accuracy, the fleet's task measures mse"),
        (_report("mse", 2e6), "mse", "mse 2e\\+06, over the bound 1e\\+06"),
        (_report("mse", 0.5, 1e7), "mse", "mse 1e\\+07, over the bound"),
    ],
)
def test_the_coordinator_refuses_another_metric_or_an_error_over_its_bound(
    report: EvaluationReport, metric: str, complaint: str
) -> None:
    with pytest.raises(ProtocolError, match=complaint):
        check_evaluation(report, metric, 1e6, "t")


@pytest.mark.parametrize(
    ("report", "metric"),
    [(_report("mse", 1e6, 0.0), "mse"), (_report("accuracy", 1.0, 0.0), "accuracy")],
)
def test_the_coordinator_takes_a_report_within_its_bounds(
    report: EvaluationReport, metric: str
) -> None:
    check_evaluation(report, metric, 1e6, "t")  # raises nothing


def _poisoner(broker: InProcessBroker) -> list[int]:
    """A client with a device's identity answering each evaluation with an accuracy of 1e30."""
    sent: list[int] = []

    def on_round(transport: Transport, message: RoundAnnouncement) -> None:
        if message.phase != "evaluate":
            return
        honest = _report("accuracy", 0.5, 0.5).model_copy(
            update={"run_id": message.run_id, "round_id": message.round_id}
        )
        raw = json.loads(honest.model_dump_json())
        raw["personalized"] = raw["global_model"] = 1e30  # within the wire's float bound
        body = json.dumps(raw).encode()
        frame = b"PFL\x01" + len(body).to_bytes(4, "big") + body
        transport.publish(topics.device("default", "liar", "evaluation"), frame)
        sent.append(message.round_id)

    hub_impostor(broker, "liar", on_round)
    return sent


def test_an_accuracy_of_1e30_is_dropped_counted_and_leaves_the_fleet_metrics_alone() -> None:
    # Prepare
    broker = InProcessBroker()
    coordinator = hub_coordinator(broker, "fedavg", len(HONEST) + 1, 1)
    coordinator.settings = replace(coordinator.settings, metric="accuracy")
    coordinator.start()
    hub_agents(broker, HONEST)
    sent = _poisoner(broker)
    assert coordinator.wait_for_devices(len(HONEST) + 1, 2.0)
    coordinator.run_round()

    # Execute
    reports, metrics = coordinator.evaluate(final=True)

    # Assert
    assert sent == [1]
    assert [r.device_id for r in reports] == HONEST
    assert coordinator.offences.counts() == {"liar": 1}
    assert all(0.0 <= value <= 1.0 for value in metrics.values() if value is not None)
    assert metrics["personalized_mean"] == sum(r.personalized for r in reports) / len(HONEST)
