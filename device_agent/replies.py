"""What an agent answers with, and how it tells one piece of work from another."""

from __future__ import annotations

from device_agent.algorithms.base import LocalResult
from pfl_tasks.base import MetricName
from protocols.codec import Tensors, pack_tensors
from protocols.messages import DeviceUpdate, EvaluationReport, RoundAnnouncement


def update_message(
    announcement: RoundAnnouncement,
    device_id: str,
    result: LocalResult,
    encoded: Tensors,
    within_clip: float | None,
) -> tuple[DeviceUpdate, bytes]:
    """The DeviceUpdate of `result` and its blob, the delta already encoded for the uplink."""
    manifest, blob = pack_tensors(encoded)
    message = DeviceUpdate(
        run_id=announcement.run_id,
        round_id=announcement.round_id,
        device_id=device_id,
        algorithm=announcement.algorithm,
        num_samples=result.num_samples,
        train_loss=result.train_loss,
        scalars=result.scalars,
        compression=announcement.uplink,
        within_clip=within_clip,
        manifest=manifest,
    )
    return message, blob


def evaluation_report(
    announcement: RoundAnnouncement,
    device_id: str,
    metric_name: MetricName,
    personalized: float,
    global_metric: float | None,
    samples: tuple[int, int],
) -> EvaluationReport:
    """The report of an evaluation; `samples` are the (test, declared train) counts."""
    return EvaluationReport(
        run_id=announcement.run_id,
        round_id=announcement.round_id,
        device_id=device_id,
        metric_name=metric_name,
        personalized=personalized,
        global_model=global_metric,
        num_test_samples=samples[0],
        num_train_samples=samples[1],
    )


def sighting(announcement: RoundAnnouncement) -> tuple[str, int, str, float]:
    """One publication of an announcement.

    A retained copy seen again after a reconnect is not new work; a re-publication (a retried
    round) is.
    """
    return (announcement.run_id, announcement.round_id, announcement.phase, announcement.sent_at)


def work_key(announcement: RoundAnnouncement) -> tuple[str, int, str, str]:
    """The work an announcement asks for: the same key means the same answer, within one run."""
    return (
        announcement.run_id,
        announcement.round_id,
        announcement.phase,
        announcement.model_sha256,
    )
