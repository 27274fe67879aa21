"""`pfl-coord serve`: rounds with real devices over MQTT, checkpointed after every round."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Final

from coordinator.dashboard.feeds import ViewTap
from coordinator.dashboard.history import RunHistoryLog, publish_history, publish_round
from coordinator.engine.metrics import RunRecorder
from coordinator.engine.rounds import Coordinator, RoundRecord, coordinator_will
from coordinator.ops.earlier_run import earlier_run_problem
from coordinator.ops.round_line import round_line
from coordinator.run.checkpoint import (
    load_checkpoint,
    restore_checkpoint,
    save_checkpoint,
)
from coordinator.run.embedded import EmbeddedRun, start_embedded
from coordinator.run.pipeline import (
    RoundCallback,
    RunResult,
    Stages,
    build_coordinator,
    drive_rounds,
    plan_stages,
    summarize_run,
)
from coordinator.run.settings import ServeSettings
from coordinator.scheduling.asynchronous import BufferedRounds
from coordinator.stages.privacy import privacy_engine
from pfl_tasks.registry import load_task
from protocols.errors import PflError, RoundError
from protocols.id_list import listed
from protocols.messages import EvaluationReport
from protocols.offences import Offences
from protocols.start_line import start_line
from protocols.transport.base import Transport
from protocols.transport.factory import connect
from protocols.transport.run_access import coordinator_client_id

logger = logging.getLogger(__name__)
WAIT_PROGRESS_S = 10.0
RETRY_BACKOFF_S: Final = 5.0
"""The least a first failed round attempt lasts before the retry; doubled for each further one."""
"""How often a coordinator waiting for devices says who is there."""
Notify = Callable[[str], None]
WAITING_SHOWN: Final = 8
"""Device ids a waiting line names in each of its groups; the rest are counted."""

_SAME_RUN_KEYS: Final = (
    "task",
    "task_options",
    "algorithm",
    "algorithm_options",
    "seed",
    "fleet",
    "participation",
    "local_epochs",
    "batch_size",
    "lr",
    "personal",
    "personal_preset",
    "pretrain_rounds",
    "dp_noise",
    "dp_clip",
    "dp_mechanism",
    "dp_sampling",
    "dp_placement",
    "dp_options",
)


ServeResult = RunResult
"""What `run_serve` returns: this process's round records and the final reports and model."""


def run_serve(
    settings: ServeSettings,
    on_round: RoundCallback | None = None,
    notify: Notify | None = None,
    linger: Callable[[ServeResult], None] | None = None,
) -> ServeResult:
    """Coordinate a whole federated run with real devices, resuming from a checkpoint if asked.

    `notify` receives one-line milestones (broker URL, waiting, retries) for a CLI to show.
    With a dashboard, `linger` is called once the run is over, the page still up (it shows the
    end of the run until `linger` returns: e.g. until the operator presses Ctrl-C).

    Raises:
        ValueError: an unknown task, algorithm or option, a checkpoint of another run, or MQTT 5
            asked of the embedded broker.
        RoundError: too few devices joined, or a round missed its quorum on every retry.
        StateError: a checkpoint could not be read or written.
    """
    say = notify or (lambda text: None)
    refuse_overwrite(settings)
    task = load_task(settings.task, settings.task_options)
    workspace = task.build_model(settings.seed)
    stages = plan_stages(settings, task, workspace)
    embedded: EmbeddedRun | None = None
    if settings.broker is None:
        if settings.mqtt_version != "3.1.1":
            msg = "the embedded broker speaks MQTT 3.1.1 only: give --broker for MQTT 5"
            raise ValueError(msg)
        accounts_dir = (settings.out or settings.checkpoint_dir) / "broker"
        embedded = start_embedded(settings.host, settings.port, settings.fleet, accounts_dir)
        base = settings.broker_settings(embedded.broker.url)
        broker = embedded.settings(base)
        logger.info("no --broker given: started an embedded MQTT broker on %s", base.url)
        say(f"embedded MQTT broker listening on {base.url}")
        say(f"  this run's broker accounts: {', '.join(map(str, embedded.env_files))}")
    else:
        broker = settings.broker_settings(settings.broker)
    say(
        start_line(
            f"coordinator {coordinator_client_id(settings.fleet)}",
            broker.url,
            settings.fleet,
            broker.username,
        )
    )
    try:
        offences = Offences()  # the transport's drops and the engine's, per device, in one count
        transport = connect(
            broker,
            coordinator_client_id(settings.fleet),
            coordinator_will(settings.fleet),
            clean_start=True,
            offences=offences,
        )
        engine = settings.engine_settings(task, stages.total_rounds)
        privacy = privacy_engine(settings.privacy(), settings.participation, None)
        try:
            with ExitStack() as dashboard:
                engine_transport: Transport = transport
                board_settings = settings.dashboard_settings()
                if board_settings is not None:  # fed by the engine: no second MQTT session
                    from coordinator.dashboard.launch import engine_dashboard  # the web stack

                    board = dashboard.enter_context(
                        engine_dashboard(board_settings, broker.url, settings.fleet, say)
                    )
                    tap = ViewTap(transport, settings.fleet, board.offer)
                    engine_transport = dashboard.enter_context(tap)
                coordinator = build_coordinator(
                    lambda: engine_transport, stages, workspace, engine, task, privacy, offences
                )
                with stops_said(coordinator):
                    result = _serve(coordinator, stages, settings, on_round, say)
                if linger is not None and board_settings is not None:
                    transport.close()  # the run's MQTT session ends; its page stays up
                    linger(result)
                return result
        finally:
            transport.close()
    finally:
        if embedded is not None:
            embedded.stop()


def _serve(
    coordinator: Coordinator,
    stages: Stages,
    settings: ServeSettings,
    on_round: RoundCallback | None,
    say: Notify,
) -> ServeResult:
    started = time.perf_counter()
    run_settings = settings.model_dump(mode="json", exclude={"password"})
    kept_lines = _resume(coordinator, stages, settings, run_settings, say)
    recorder = RunRecorder(settings.out, run_settings)
    history = RunHistoryLog(settings.fleet, run_settings)
    for line in kept_lines:
        kept = json.loads(line)
        recorder.record_round(kept)
        history.add_round(kept)
    coordinator.start()
    publish_history(coordinator, history)  # the settings, before the first round
    _wait_for_fleet(coordinator, settings, say)

    asynchronous = settings.async_settings()
    engine = (
        None
        if asynchronous is None
        else BufferedRounds(coordinator, asynchronous, None, settings.participation)
    )

    def run_round() -> RoundRecord:
        coordinator.publish_status("running")
        run = coordinator.run_round if engine is None else engine.run_round
        return _run_round_with_retries(coordinator, settings, say, run)

    def after_round(record: RoundRecord, evaluated: Sequence[EvaluationReport]) -> None:
        line = record.line()
        recorder.record_round(line, evaluated, coordinator.last_fleet_status)
        publish_round(coordinator, history, line, evaluated)
        save_checkpoint(settings.checkpoint_dir, coordinator, run_settings)
        say(round_line(record, stages.total_rounds))
        if on_round is not None:
            on_round(record)

    records, reports = drive_rounds(
        coordinator, stages, run_round=run_round, after_round=after_round, scheduler=engine
    )
    final_shared = coordinator.shared
    summary = summarize_run(
        coordinator,
        stages,
        settings,
        records,
        reports,
        devices=coordinator.registry.count(),
        traffic=(coordinator.bytes_up, coordinator.bytes_down),
        started=started,
    )
    recorder.write_devices(reports)
    recorder.write_summary(summary)
    return ServeResult(summary, records, reports, final_shared)


def refuse_overwrite(settings: ServeSettings) -> None:
    """An earlier run's checkpoint or metrics are never silently replaced.

    Raises:
        ValueError: they exist and neither --resume (continue them) nor --fresh (replace them)
            was given, or both were.
    """
    if settings.resume and settings.fresh:
        msg = "--resume continues the earlier run and --fresh replaces it: give one of them"
        raise ValueError(msg)
    if settings.resume or settings.fresh:
        return
    problem = earlier_run_problem(settings.checkpoint_dir, settings.out)
    if problem is not None:
        raise ValueError(problem)


def _resume(
    coordinator: Coordinator,
    stages: Stages,
    settings: ServeSettings,
    run_settings: dict[str, Any],
    say: Notify,
) -> list[str]:
    """Restore the last checkpoint if asked; return the metrics lines of the rounds it covers."""
    if not settings.resume:
        return []
    checkpoint = load_checkpoint(settings.checkpoint_dir)
    if checkpoint is None:
        say(f"no checkpoint in {settings.checkpoint_dir}: starting from round 1")
        return []
    saved = checkpoint.record.settings
    differing = [key for key in _SAME_RUN_KEYS if saved.get(key) != run_settings.get(key)]
    if differing:
        msg = (
            f"the checkpoint in {settings.checkpoint_dir} belongs to another run "
            f"(different {', '.join(differing)}); use another --checkpoint-dir or the same flags"
        )
        raise ValueError(msg)
    stages.enter(coordinator, max(1, checkpoint.record.round_id))
    restore_checkpoint(coordinator, checkpoint)
    say(f"resumed after round {coordinator.round_id} from {settings.checkpoint_dir}")
    return _metrics_up_to(settings.out, coordinator.round_id)


def _metrics_up_to(out: Path | None, round_id: int) -> list[str]:
    """Lines of an earlier metrics.jsonl up to `round_id`.

    A round recorded after the checkpoint was taken runs again, so its line must not appear twice.
    """
    path = None if out is None else out / "metrics.jsonl"
    if path is None or not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return [line for line in lines if json.loads(line).get("round_id", 0) <= round_id]


def _wait_for_fleet(coordinator: Coordinator, settings: ServeSettings, say: Notify) -> None:
    """Wait for `min_devices`, saying every WAIT_PROGRESS_S who is there and who is missing."""
    deadline = time.monotonic() + settings.join_timeout
    while coordinator.registry.online_count() < settings.min_devices:
        left = deadline - time.monotonic()
        missing = [r.device_id for r in coordinator.registry.records() if not r.online and r.hello]
        coordinator.run_state.short_of_devices(
            settings.min_devices,
            coordinator.registry.online_count(),
            missing,
            joined=coordinator.round_id > 0,
            deadline=time.time() + max(0.0, left),
        )
        if left <= 0:
            msg = (
                f"only {coordinator.registry.online_count()} of {settings.min_devices} devices "
                f"online after {settings.join_timeout:g} s"
            )
            raise RoundError(msg, round_id=coordinator.round_id + 1)
        say(waiting_line(coordinator, settings.min_devices, left))
        coordinator.wait_for_devices(settings.min_devices, min(WAIT_PROGRESS_S, left))
    coordinator.run_state.enough_devices()


@contextmanager
def stops_said(coordinator: Coordinator) -> Iterator[None]:
    """A run ended by Ctrl-C or an error says so in its status (`stopped`, with the reason)."""
    try:
        yield
    except KeyboardInterrupt:
        coordinator.run_state.stop(f"interrupted (Ctrl-C) after round {coordinator.round_id}")
        raise
    except PflError as error:
        coordinator.run_state.stop(f"failed after round {coordinator.round_id}: {error}")
        raise


def waiting_line(coordinator: Coordinator, needed: int, left_s: float) -> str:
    """Who is online, who the fleet knows but misses, which ids flap, and the time left."""
    records = coordinator.registry.records()
    online = sorted(r.device_id for r in records if r.online)
    known_offline = sorted(r.device_id for r in records if not r.online and r.hello is not None)
    parts = [f"waiting for {needed} device(s): {len(online)} online"]
    if online:
        parts[0] += f" ({listed(online, WAITING_SHOWN)})"
    if known_offline:
        parts.append(f"not back yet: {listed(known_offline, WAITING_SHOWN)}")
    flapping = sorted(coordinator.flaps.flapping())
    if flapping:
        ids = listed(flapping, WAITING_SHOWN)
        parts.append(f"rejoining every few seconds (one id on two devices?): {ids}")
    parts.append(f"{left_s:.0f} s until the join timeout")
    return "; ".join(parts)


def retry_pause_s(attempt: int, elapsed_s: float, round_timeout_s: float) -> float:
    """How long to wait before retry `attempt`, so that quick failures do not burn the retries.

    A round every selected device declined fails at once: retried at once, the same devices
    (charging, busy, short of memory) would decline again and the run would end in seconds.
    Each attempt lasts at least 5 s, 10 s, 20 s, ... (never more than the round deadline).
    """
    least = min(round_timeout_s, RETRY_BACKOFF_S * 2.0 ** (attempt - 1))
    return max(0.0, least - elapsed_s)


def _run_round_with_retries(
    coordinator: Coordinator,
    settings: ServeSettings,
    say: Notify,
    run_round: Callable[[], RoundRecord],
) -> RoundRecord:
    attempt = 0
    while True:
        _wait_for_fleet(coordinator, settings, say)
        started = time.monotonic()
        try:
            return run_round()
        except RoundError as error:
            attempt += 1
            if attempt > settings.round_retries:
                raise
            pause = retry_pause_s(attempt, time.monotonic() - started, settings.round_timeout)
            logger.warning(
                "round %d failed (%s); retry %d of %d",
                coordinator.round_id + 1,
                error,
                attempt,
                settings.round_retries,
            )
            say(f"round {coordinator.round_id + 1} failed ({error}); retrying in {pause:.0f} s")
            time.sleep(pause)
