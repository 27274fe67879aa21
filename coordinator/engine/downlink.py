"""What devices download: the retained shared model, and with `--compress-down int8` a delta.

Devices subscribe to the model only for work they are asked to do and only when they do not
hold the announced one (`device_agent.downloads`), so the engine publishes each model once and
counts download bytes per device asked, from what each device is known to hold: the model of
the last announcement it answered.

With int8 downlink the published model is the previous one plus the decoded int8 delta, not the
aggregate itself: a device that applies the delta and one that downloads the whole model then
hold the same bits. The aggregate stays the engine's model, so the part the int8 step missed is
sent with the next delta (error feedback on the server side).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Literal

import torch

from protocols import topics
from protocols.codec import Tensors, encode_frame, pack_tensors
from protocols.compression import encode_model_delta
from protocols.messages import ModelDelta, SharedModel
from protocols.transport.base import Transport

logger = logging.getLogger(__name__)
DownlinkCodec = Literal["none", "int8"]


class ModelPublisher:
    """Publishes the shared model (and its delta) retained, and knows what each device holds."""

    def __init__(self, transport: Transport, fleet: str, codec: DownlinkCodec = "none") -> None:
        self.transport = transport
        self.fleet = fleet
        self.codec = codec
        self.sha = ""
        self.delta_base: str | None = None
        self.published: Tensors = {}
        """The model devices hold: the aggregate, or with int8 downlink its rebuilt copy."""
        self._frames: dict[str, bytes] = {}
        self._held: dict[str, str] = {}

    def publish(self, model: Mapping[str, torch.Tensor], round_id: int, *, force: bool) -> None:
        """Retain `model` (with int8 downlink, as rebuilt from a delta when one applies).

        An unchanged model is sent again only with force=True (a restarted broker lost it).
        """
        encoded = self._delta_from_published(model)
        target = dict(model) if encoded is None else encoded[1]
        manifest, blob = pack_tensors(target)
        if manifest.sha256 == self.sha:
            if force:
                for topic, frame in self._frames.items():
                    self.transport.publish(topic, frame, retain=True)
            return
        frame = encode_frame(SharedModel(round_id=round_id, manifest=manifest), blob)
        self._frames = {topics.shared_model(self.fleet): frame}
        self.delta_base = None
        if encoded is not None:
            delta_manifest, delta_blob = pack_tensors(encoded[0])
            header = ModelDelta(
                round_id=round_id,
                base_sha256=self.sha,
                target_sha256=manifest.sha256,
                manifest=delta_manifest,
            )
            self._frames[topics.model_delta(self.fleet)] = encode_frame(header, delta_blob)
            self.delta_base = self.sha
        for topic, frame in self._frames.items():
            self.transport.publish(topic, frame, retain=True)
        self.sha, self.published = manifest.sha256, target

    def acknowledge(self, device_id: str) -> None:
        """`device_id` answered work on the current model: it holds it."""
        self._held[device_id] = self.sha

    def forget(self, device_id: str) -> None:
        """`device_id` (re)started: assume it holds nothing."""
        self._held.pop(device_id, None)

    def downloads(self, devices: Iterable[str]) -> dict[str, int]:
        """The bytes each of `devices` downloads to work on the current model: 0, delta or whole."""
        sizes = {}
        for device_id in devices:
            held = self._held.get(device_id)
            if held == self.sha:
                sizes[device_id] = 0
                continue
            use_delta = held is not None and held == self.delta_base
            topic = topics.model_delta(self.fleet) if use_delta else topics.shared_model(self.fleet)
            sizes[device_id] = len(self._frames.get(topic, b""))
        return sizes

    def _delta_from_published(
        self, model: Mapping[str, torch.Tensor]
    ) -> tuple[Tensors, Tensors] | None:
        if self.codec != "int8" or not self.published:
            return None
        return encode_model_delta(self.published, model)
