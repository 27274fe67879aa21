"""A device agent's export: its personalized model to ONNX, live or from kept frames.

Mixed into `DeviceAgent`; the work itself is in `device_agent.exporting`.
"""

from __future__ import annotations

from pathlib import Path

from device_agent.algorithms.base import LocalContext, LocalUpdate
from device_agent.context import RoundContexts
from device_agent.exporting import ExportSource, export_device_model
from device_agent.received import ReceivedModel
from device_agent.relay import RelayClient, latest_round
from pfl_tasks.base import DeviceData, Task
from protocols.codec import Tensors
from protocols.errors import StateError
from protocols.messages import ExportReport, RoundAnnouncement


class AgentExports:
    """What `pfl-agent export` and the export command ask of an agent."""

    device_id: str
    task: Task
    data: DeviceData
    seed: int
    initial_state: Tensors
    contexts: RoundContexts
    relay: RelayClient
    last_announcement: RoundAnnouncement | None
    _model: ReceivedModel | None

    def export(
        self, out_path: Path, *, quantize: str | None = None, guard: bool = False
    ) -> ExportReport:
        """Write this device's personalized model to `out_path` as a verified ONNX file.

        Failures (no round seen yet, personal state for another architecture, a failed parity
        check) come back as ok=False with the error, so a command is always answered.
        """
        return export_device_model(
            self.export_source(), Path(out_path), quantize=quantize, guard=guard
        )

    def export_source(self) -> ExportSource:
        """What an export of this device reads, without the agent itself."""
        return ExportSource(
            device_id=self.device_id,
            task=self.task,
            data=self.data,
            seed=self.seed,
            initial_state=self.initial_state,
            latest_round_id=self.latest_round_id(),
            context=self.export_context,
        )

    def export_context(self) -> tuple[int, LocalUpdate, LocalContext]:
        """The export's round, and the context of the latest round with its model loaded.

        Raises:
            StateError: no round announcement or shared model received yet.
            PflError: the personal state does not fit (StateError) or the model is malformed.
        """
        announcement, model = self.last_announcement, self._model
        if announcement is None or model is None:
            msg = "no round seen yet: a device exports after it has received a round and a model"
            raise StateError(msg, device_id=self.device_id)
        update, ctx = self.contexts.build(announcement, model, self.relay.export_models())
        return self.relay.export_round(update, announcement, model), update, ctx

    def latest_round_id(self) -> int:
        """The round of the latest shared model received (0 before any)."""
        return 0 if self._model is None else latest_round(self._model, self.last_announcement)

    def load_received(
        self,
        model_frame: bytes,
        announcement: RoundAnnouncement,
        mixture: dict[str, Tensors] | None = None,
    ) -> None:
        """Take kept frames (and an evaluation's relayed models) as received, offline.

        Raises:
            ProtocolError: the model frame is malformed or not a shared model.
        """
        self._model = ReceivedModel.from_frame(model_frame)
        self.last_announcement = announcement
        self.relay.mixture = dict(mixture or {})
