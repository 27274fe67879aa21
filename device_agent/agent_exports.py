"""A device agent's export: its personalized model to ONNX, live or from kept frames.

`DeviceAgent` holds one as `exports`; the work itself is in `device_agent.exporting`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from device_agent.algorithms.base import LocalContext, LocalUpdate
from device_agent.context import RoundContexts
from device_agent.exporting import ExportSource, export_device_model
from device_agent.received import ReceivedModel
from device_agent.relay import RelayClient, latest_round
from protocols.codec import Tensors
from protocols.errors import StateError
from protocols.messages import ExportReport, RoundAnnouncement

Latest = Callable[[], tuple[RoundAnnouncement | None, ReceivedModel | None]]
"""The latest round announcement and shared model a device received (None before any)."""


class AgentExports:
    """What `pfl-agent export` and the export command ask of an agent.

    It reads the agent's round contexts and relay, and asks `latest` for what the agent last
    received, so it always exports the agent's current state.
    """

    def __init__(self, contexts: RoundContexts, relay: RelayClient, latest: Latest) -> None:
        self.contexts = contexts
        self.relay = relay
        self._latest = latest

    def export(
        self, out_path: Path, *, quantize: str | None = None, guard: bool = False
    ) -> ExportReport:
        """Write this device's personalized model to `out_path` as a verified ONNX file.

        Failures (no round seen yet, personal state for another architecture, a failed parity
        check) come back as ok=False with the error, so a command is always answered.
        """
        return export_device_model(self.source(), Path(out_path), quantize=quantize, guard=guard)

    def source(self) -> ExportSource:
        """What an export of this device reads, without the agent itself."""
        device = self.contexts.device
        return ExportSource(
            device_id=device.device_id,
            task=device.task,
            data=device.data,
            seed=device.seed,
            initial_state=device.initial_state,
            latest_round_id=self.latest_round_id(),
            context=self.context,
        )

    def context(self) -> tuple[int, LocalUpdate, LocalContext]:
        """The export's round, and the context of the latest round with its model loaded.

        Raises:
            StateError: no round announcement or shared model received yet.
            PflError: the personal state does not fit (StateError) or the model is malformed.
        """
        announcement, model = self._latest()
        if announcement is None or model is None:
            msg = "no round seen yet: a device exports after it has received a round and a model"
            raise StateError(msg, device_id=self.contexts.device.device_id)
        update, ctx = self.contexts.build(announcement, model, self.relay.export_models())
        return self.relay.export_round(update, announcement, model), update, ctx

    def latest_round_id(self) -> int:
        """The round of the latest shared model received (0 before any)."""
        announcement, model = self._latest()
        return 0 if model is None else latest_round(model, announcement)

    def load_received(
        self,
        model_frame: bytes,
        announcement: RoundAnnouncement,
        mixture: dict[str, Tensors] | None = None,
    ) -> None:
        """Export kept frames (and an evaluation's relayed models) from now on, offline.

        What the agent receives afterwards no longer reaches this export.

        Raises:
            ProtocolError: the model frame is malformed or not a shared model.
        """
        model = ReceivedModel.from_frame(model_frame)
        self._latest = lambda: (announcement, model)
        self.relay.mixture = dict(mixture or {})
