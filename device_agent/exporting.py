"""A device's personalized model to a verified ONNX file, answered to the fleet as ExportReport.

The device assembles what it would deploy from the latest shared model and round it saw plus its
personal state, personalizes it with its algorithm's stage c (`LocalUpdate.personalize`),
optionally lets the personalization guard ship the global model instead, and writes the file with
`export.export_model`. Every failure becomes an `ExportReport` with ok=False and the error text:
an export command must always be answered, and never raise into the transport.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from torch import nn

from device_agent.algorithms.base import is_relay, relay_update
from device_agent.state_store import DiskStateStore, StateStore
from device_agent.training import ModelSlots, evaluate
from export import ExportProvenance, ExportResult, choose_model, export_model
from export.metadata import Chosen
from export.quantize import Quantization, check_quantization
from pfl_tasks.base import Task
from protocols.errors import PflError, StateError
from protocols.messages import Command, ExportReport

if TYPE_CHECKING:
    from device_agent.agent import DeviceAgent

logger = logging.getLogger(__name__)

MAX_ERROR_CHARS: Final = 4096
_TRUE: Final = ("true", "1", "yes")
_FALSE: Final = ("false", "0", "no", "")


@dataclass(frozen=True)
class ExportRequest:
    """The export command's arguments, validated: where to write, int8 or not, guard or not."""

    out_dir: Path | None = None
    quantize: Quantization | None = None
    guard: bool = False

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, str]) -> ExportRequest:
        """Parse `Command.arguments` ("out_dir", "quantize": "int8" or "", "guard": "true"/"false").

        Raises:
            ValueError: an unknown argument or value, naming the valid ones.
        """
        unknown = sorted(set(arguments) - {"out_dir", "quantize", "guard"})
        if unknown:
            msg = f"unknown export argument(s) {', '.join(unknown)}; use out_dir, quantize, guard"
            raise ValueError(msg)
        guard_text = arguments.get("guard", "").strip().lower()
        if guard_text not in (*_TRUE, *_FALSE):
            msg = f"guard must be 'true' or 'false', got {arguments['guard']!r}"
            raise ValueError(msg)
        out_dir = arguments.get("out_dir", "")
        return cls(
            out_dir=Path(out_dir) if out_dir else None,
            quantize=check_quantization(arguments.get("quantize") or None),
            guard=guard_text in _TRUE,
        )

    def as_arguments(self) -> dict[str, str]:
        """The command arguments that parse back to this request."""
        return {
            "out_dir": "" if self.out_dir is None else str(self.out_dir),
            "quantize": self.quantize or "",
            "guard": "true" if self.guard else "false",
        }


def answer_export_command(agent: DeviceAgent, command: Command) -> ExportReport:
    """Handle Command(action="export"): write `<out_dir or state dir>/<device_id>.onnx`.

    The device's retained status reads "exporting" meanwhile, then "online" with the error, if
    any, as its detail, so `pfl-coord status` shows a failed export too.
    """
    try:
        request = ExportRequest.from_arguments(command.arguments)
        directory = request.out_dir or state_directory(agent.store)
    except (PflError, ValueError) as error:
        return failed_report(agent.device_id, 0, error)
    agent.publish_status("exporting")
    report = agent.export(
        directory / f"{agent.device_id}.onnx", quantize=request.quantize, guard=request.guard
    )
    agent.publish_status("online", round_id=report.round_id, detail=report.error)
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
    agent: DeviceAgent,
    out_path: Path,
    *,
    quantize: str | None = None,
    guard: bool = False,
) -> ExportReport:
    """Personalize, optionally guard, export and verify; report the outcome, never raise.

    The model is a fresh `task.build_model(seed)` holding the agent's assembled state, so a
    workspace shared by virtual devices is neither exported by reference nor changed by the
    stage-c fine-tune. The generator is the one the last round's context derives, so after a
    final evaluation the exported model is exactly the one that evaluation scored.

    Returns:
        ok=True with the file's path, size, SHA-256, parity and metrics; or ok=False with the
        error (no round seen, personal state for another architecture, failed parity, ...).
    """
    round_id = agent.latest_round_id()
    try:
        checked = check_quantization(quantize)
        round_id, update, ctx = agent.export_context()
        if is_relay(update):  # a mixture of relayed models: there is no global model to guard
            if guard:
                msg = (
                    f"{update.name} has no global model: the guard cannot choose; export without it"
                )
                raise ValueError(msg)
            model = relay_update(update).deployable(ctx)
            shared = model.state_dict()  # the mixture's models: what the metadata hashes
            chosen: Chosen = "personalized"
            scores = {
                "personalized": evaluate(model, agent.task, agent.data.val),
                "global": math.nan,
            }
        else:
            personalized = fresh_model(agent.task, agent.seed, [ctx.model.state_dict()])
            ctx = dataclasses.replace(ctx, model=personalized)
            update.personalize(ctx)
            global_model = fresh_model(
                agent.task, agent.seed, [agent.initial_state, ctx.global_shared]
            )
            model, chosen, scores = _decide(personalized, global_model, agent, guard)
            shared = ctx.global_shared
        result = export_model(
            model,
            agent.task,
            out_path,
            provenance=ExportProvenance(
                algorithm=ctx.config.name,
                round_id=round_id,
                device_id=agent.device_id,
                chosen=chosen,
                personalized_metric=scores["personalized"],
                global_metric=scores["global"],
            ),
            shared=shared,
            heldout=agent.data.test,
            quantize=checked,
        )
    except (PflError, ValueError, TypeError) as error:
        logger.warning("device %s: export failed: %s", agent.device_id, error)
        return failed_report(agent.device_id, round_id, error)
    except Exception as error:  # never into the transport: the coordinator waits for an answer
        logger.exception("device %s: export failed unexpectedly", agent.device_id)
        return failed_report(agent.device_id, round_id, error)
    return ExportReport(
        round_id=round_id,
        device_id=agent.device_id,
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


def report_metrics(result: ExportResult, scores: Mapping[str, float]) -> dict[str, float]:
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


def _decide(
    personalized: nn.Module, global_model: nn.Module, agent: DeviceAgent, guard: bool
) -> tuple[nn.Module, Chosen, dict[str, float]]:
    """The guard's choice, or the personalized model with both validation scores for the record."""
    if guard:
        return choose_model(personalized, global_model, agent.task, agent.data.val)
    scores = {
        "personalized": evaluate(personalized, agent.task, agent.data.val),
        "global": evaluate(global_model, agent.task, agent.data.val),
    }
    return personalized, "personalized", scores


def export_fleet(
    agents: Iterable[DeviceAgent],
    directory: Path,
    *,
    quantize: str | None = None,
    guard: bool = False,
) -> dict[str, Any]:
    """Export every agent's model to `directory/<device_id>.onnx` (simulate --export-dir).

    `quantize` and `guard` are the export command's options (an int8 file beside each; the
    personalization guard), so a simulation can try what a fleet export would ship.

    Returns:
        The summary's "export" entry: the directory, how many files were written and verified,
        their total size, each failed device's error, and how many shipped the global model.
    """
    reports = [
        agent.export(directory / f"{agent.device_id}.onnx", quantize=quantize, guard=guard)
        for agent in agents
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
