"""`pfl-agent export`: the personalized model from a stopped agent's state directory, offline."""

from __future__ import annotations

import logging
from pathlib import Path

from device_agent.received import load_received
from device_agent.runner import build_agent
from device_agent.settings import AgentSettings
from protocols.errors import StateError
from protocols.messages import ExportReport

logger = logging.getLogger(__name__)


def recorded_device_id(state_dir: Path) -> str | None:
    """The device id the agent that filled `state_dir` ran as, if it recorded one."""
    try:
        return load_received(state_dir).device_id or None
    except StateError:
        return None


def export_offline(
    settings: AgentSettings, out_path: Path, *, quantize: str | None = None, guard: bool = False
) -> ExportReport:
    """Export from the frames and personal state an agent kept in `settings.state_dir`.

    The agent is rebuilt from the same settings as `pfl-agent start` (task, data shard, seed),
    on a private in-process transport that reaches no broker, and fed the kept shared model and
    round announcement, so the file is the one the running agent would have written.

    Raises:
        StateError: the state directory holds no received round, or another device's.
        ValueError: unknown task or unusable data.
    """
    received = load_received(settings.state_dir)
    if received.device_id and received.device_id != settings.device_id:
        msg = (
            f"{settings.state_dir} belongs to device {received.device_id!r}, not "
            f"{settings.device_id!r}: pass --device-id {received.device_id} or its own --state-dir"
        )
        raise StateError(msg)
    agent = build_agent(settings, offline=True)
    exports = agent.exports
    exports.load_received(received.model_frame, received.announcement, received.relayed)
    logger.info(
        "exporting %s from round %d (%s) kept in %s",
        settings.device_id,
        exports.latest_round_id(),
        received.announcement.algorithm,
        settings.state_dir,
    )
    return exports.export(out_path, quantize=quantize, guard=guard)
