"""A device's personalized model to a verified ONNX file, answered to the fleet as ExportReport.

The device assembles what it would deploy from the latest shared model and round it saw plus its
personal state, personalizes it with its algorithm's stage c (`LocalUpdate.personalize`),
optionally lets the personalization guard ship the global model instead, and writes the file with
`export.export_model`. Every failure becomes an `ExportReport` with ok=False and the error text:
an export command must always be answered, and never raise into the transport.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final, Protocol

from torch import nn

from device_agent.algorithms.base import LocalContext, LocalUpdate
from device_agent.relay import relay_mixture
from device_agent.state_store import DiskStateStore, StateStore
from device_agent.training import ModelSlots, evaluate
from pfl_tasks.base import DeviceData, Task
from protocols.codec import Tensors
from protocols.errors import PflError, StateError
from protocols.messages import Command, ExportArguments, ExportReport
from protocols.own_packages import own_module

if TYPE_CHECKING:  # at run time, our export package even where a user's export.py shadows it
    import export
    import export.quantize
    from export.metadata import Chosen

logger = logging.getLogger(__name__)

MAX_ERROR_CHARS: Final = 4096


@dataclass(frozen=True)
class ExportSource:
    """What an export reads of a device, and nothing more (no transport, no agent).

    `context` gives the round the export stems from and the latest round's local update and
    context with the personal state loaded (raising StateError before any round).
    """

    device_id: str
    task: Task
    data: DeviceData
    seed: int
    initial_state: Tensors
    latest_round_id: int
    context: Callable[[], tuple[int, LocalUpdate, LocalContext]]


class StatusPublisher(Protocol):
    """How the device tells the fleet it is exporting (its retained status)."""

    def __call__(self, state: str, *, round_id: int | None = None, detail: str = "") -> None:
        """Publish `state` as the device's retained status."""
        ...


def answer_export_command(
    source: ExportSource, command: Command, store: StateStore, publish_status: StatusPublisher
) -> ExportReport:
    """Handle Command(action="export"): write `<out_dir or state dir>/<device_id>.onnx`.

    The device's retained status reads "exporting" meanwhile, then "online" with the error, if
    any, as its detail, so `pfl-coord status` shows a failed export too.
    """
    arguments = command.export or ExportArguments()
    try:
        directory = Path(arguments.out_dir) if arguments.out_dir else state_directory(store)
    except PflError as error:
        return failed_report(source.device_id, 0, error)
    publish_status("exporting")
    report = export_device_model(
        source,
        directory / f"{source.device_id}.onnx",
        quantize=arguments.quantize,
        guard=arguments.guard,
    )
    publish_status("online", round_id=report.round_id, detail=report.error)
    return report


def state_directory(store: StateStore) -> Path:
    """The agent's state directory, where an export without out_dir goes.

    Raises:
        StateError: the agent keeps its state in memory (a virtual device).
    """
    if isinstance(store, DiskStateStore):
        return store.directory
    msg = "this device has no state directory: give the export command an out_dir"
    raise StateError(msg)


def export_device_model(
    source: ExportSource,
    out_path: Path,
    *,
    quantize: str | None = None,
    guard: bool = False,
) -> ExportReport:
    """Personalize, optionally guard, export and verify; report the outcome, never raise.

    The model is a fresh `task.build_model(seed)` holding the device's assembled state, so a
    workspace shared by virtual devices is neither exported by reference nor changed by the
    stage-c fine-tune. The generator is the one the last round's context derives, so after a
    final evaluation the exported model is exactly the one that evaluation scored.

    Returns:
        ok=True with the file's path, size, SHA-256, parity and metrics; or ok=False with the
        error (no round seen, personal state for another architecture, failed parity, ...).
    """
    round_id = source.latest_round_id
    export = _export_package()
    try:
        checked = export.quantize.check_quantization(quantize)
        round_id, update, ctx = source.context()
        mixture = relay_mixture(update, ctx)
        chosen: Chosen = "personalized"
        if mixture is None:
            personalized = fresh_model(source.task, source.seed, [ctx.model.state_dict()])
            ctx = dataclasses.replace(ctx, model=personalized, slots=None)  # not the workspace's
            update.personalize(ctx)
            own = {name: ctx.personal[name] for name in ctx.split.by_kind}  # its statistics
            global_model = fresh_model(
                source.task, source.seed, [source.initial_state, ctx.global_shared, own]
            )
            model, chosen, scores = _decide(personalized, global_model, source, guard)
            shared = ctx.global_shared
        else:  # a mixture of relayed models: there is no global model to guard
            if guard:
                msg = (
                    f"{update.name} has no global model: the guard cannot choose; export without it"
                )
                raise ValueError(msg)
            model = mixture
            shared = model.state_dict()  # the mixture's models: what the metadata hashes
            scores = {
                "personalized": evaluate(model, source.task, source.data.val),
                "global": math.nan,
            }
        result = export.export_model(
            model,
            source.task,
            out_path,
            provenance=export.ExportProvenance(
                algorithm=ctx.config.name,
                round_id=round_id,
                device_id=source.device_id,
                chosen=chosen,
                personalized_metric=scores["personalized"],
                global_metric=scores["global"],
            ),
            shared=shared,
            heldout=source.data.test,
            quantize=checked,
            calibration=source.data.train.inputs,  # int8-static: the device's own inputs
        )
    except (PflError, ValueError, TypeError) as error:
        logger.warning("device %s: export failed: %s", source.device_id, error)
        return failed_report(source.device_id, round_id, error)
    except Exception as error:  # never into the transport: the coordinator waits for an answer
        logger.exception("device %s: export failed unexpectedly", source.device_id)
        return failed_report(source.device_id, round_id, error)
    return ExportReport(
        round_id=round_id,
        device_id=source.device_id,
        ok=True,
        path=str(result.path),
        size_bytes=result.size_bytes,
        sha256=result.sha256,
        parity_max_abs_diff=result.parity_max_abs_diff,
        metrics=report_metrics(result, scores),
    )


def fresh_model(task: Task, seed: int, states: Iterable[Mapping[str, Any]]) -> nn.Module:
    """`task.build_model(seed)` with each of `states` copied in, in order (later ones win)."""
    model = task.build_model(seed)
    slots = ModelSlots(model)
    for state in states:
        slots.load(state)
    return model


def report_metrics(result: export.ExportResult, scores: Mapping[str, float]) -> dict[str, float]:
    """The report's scalars (finite values only; a missing score is left out).

    personalized / global: the guard's validation scores; exported: the file's held-out metric
    through onnxruntime (exported_torch: PyTorch's); chosen_global: 1 when the global model was
    shipped; int8, int8_change, int8_size_bytes, int8_parity_max_abs_diff when quantized.
    """
    values = {
        "personalized": scores["personalized"],
        "global": scores["global"],
        "exported": result.metric,
        "exported_torch": result.torch_metric,
        "chosen_global": 1.0 if result.chosen == "global" else 0.0,
    }
    if result.quantized is not None:
        values.update(
            int8=result.quantized.metric,
            int8_change=result.quantized.metric_change,
            int8_size_bytes=float(result.quantized.size_bytes),
            int8_parity_max_abs_diff=result.quantized.parity_max_abs_diff,
        )
    return {key: float(value) for key, value in values.items() if math.isfinite(value)}


def failed_report(device_id: str, round_id: int | None, error: BaseException) -> ExportReport:
    """ok=False with the error's text (truncated to what the message allows)."""
    text = str(error) or type(error).__name__
    return ExportReport(
        round_id=round_id or 0, device_id=device_id, ok=False, error=text[:MAX_ERROR_CHARS]
    )


def _export_package() -> ModuleType:
    """Our export package, loaded at the first export: it brings onnx and onnxruntime."""
    package = own_module("export")
    importlib.import_module(f"{package.__name__}.quantize")
    return package


def _decide(
    personalized: nn.Module, global_model: nn.Module, source: ExportSource, guard: bool
) -> tuple[nn.Module, Chosen, dict[str, float]]:
    """The guard's choice, or the personalized model with both validation scores for the record."""
    if guard:
        choose: Callable[..., tuple[nn.Module, Chosen, dict[str, float]]]
        choose = _export_package().choose_model
        return choose(personalized, global_model, source.task, source.data.val)
    scores = {
        "personalized": evaluate(personalized, source.task, source.data.val),
        "global": evaluate(global_model, source.task, source.data.val),
    }
    return personalized, "personalized", scores


def export_fleet(
    sources: Iterable[ExportSource],
    directory: Path,
    *,
    quantize: str | None = None,
    guard: bool = False,
) -> dict[str, Any]:
    """Export every device's model to `directory/<device_id>.onnx` (simulate --export-dir).

    `quantize` and `guard` are the export command's options (an int8 file beside each; the
    personalization guard), so a simulation can try what a fleet export would ship.

    Returns:
        The summary's "export" entry: the directory, how many files were written and verified,
        their total size, each failed device's error, and how many shipped the global model.
    """
    reports = [
        export_device_model(
            source, directory / f"{source.device_id}.onnx", quantize=quantize, guard=guard
        )
        for source in sources
    ]
    failures = {r.device_id: r.error for r in reports if not r.ok}
    for device_id, error in failures.items():
        logger.warning("device %s: export failed: %s", device_id, error)
    return {
        "dir": str(directory),
        "ok": sum(1 for r in reports if r.ok),
        "failed": len(failures),
        "failures": failures,
        "total_bytes": sum(r.size_bytes for r in reports if r.ok),
        "shipped_global": sum(1 for r in reports if r.ok and r.metrics.get("chosen_global")),
    }
