import pytest

from coordinator.engine.metrics import summarize_evaluations
from pfl_tasks.base import MetricName
from protocols.messages import EvaluationReport


def _report(i: int, value: float, n_train: int, n_test: int, metric: MetricName = "accuracy"):
    return EvaluationReport(
        run_id="0" * 32,
        round_id=1,
        device_id=f"dev-{i:02d}",
        metric_name=metric,
        personalized=value,
        global_model=value / 2,
        num_test_samples=n_test,
        num_train_samples=n_train,
    )


def test_worst_and_top_metrics_follow_the_selffl_definitions() -> None:
    # Prepare: 11 devices -> ceil(1.1) = 2 in each tail
    values = [0.9, 0.1, 0.5, 0.95, 0.2, 0.6, 0.7, 0.8, 0.3, 0.4, 1.0]
    train = [10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110]
    test = [5] * 9 + [1, 3]
    reports = [
        _report(i, v, n, t) for i, (v, n, t) in enumerate(zip(values, train, test, strict=True))
    ]
    # Execute
    metrics = summarize_evaluations(reports)
    # Assert
    assert metrics["personalized_mean"] == pytest.approx(sum(values) / 11)
    assert metrics["personalized_worst10"] == pytest.approx((0.1 + 0.2) / 2)
    # the two largest devices (110, 100 train samples) weighted by test counts 3 and 1
    assert metrics["personalized_top10_weighted"] == pytest.approx((1.0 * 3 + 0.4 * 1) / 4)
    assert metrics["global"] == pytest.approx(sum(values) / 22)


def test_worst_devices_for_mse_are_the_highest_errors() -> None:
    reports = [_report(i, v, 10, 10, metric="mse") for i, v in enumerate([0.1, 5.0, 0.2, 0.3])]
    metrics = summarize_evaluations(reports)
    assert metrics["personalized_worst10"] == pytest.approx(5.0)
