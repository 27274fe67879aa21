"""Fetching the shared model only for work this device is asked to do, and only when needed.

The model is retained on its topic, so subscribing delivers the current one at once. A device
subscribes when an announcement (or an export command) needs a model it does not hold, and
unsubscribes when that model arrived: a device not selected for a round receives only the
announcement. With int8 downlink, a device holding the model the retained delta starts from
subscribes to the delta instead and rebuilds the model from it, checked against the announced
digest; anything that does not check out falls back to the whole model.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

from device_agent.received import DecodedModelCache, ReceivedModel
from protocols import topics
from protocols.codec import encode_frame, pack_tensors, unpack_tensors
from protocols.compression import (
    INT8,
    apply_model_delta,
    decode,
    encoded_layout,
    model_delta_layout,
)
from protocols.errors import ProtocolError
from protocols.messages import ModelDelta, RoundAnnouncement, SharedModel, TensorSpec
from protocols.transport.base import MessageHandler, Transport

logger = logging.getLogger(__name__)
Source = Literal["model", "delta"]
LATEST = "latest"
"""Wanted: whatever model the coordinator retains now (an export after rounds went on)."""


class ModelDownloads:
    """Which model topic this device is subscribed to, if any, and the digest it waits for."""

    def __init__(
        self, transport: Transport, fleet: str, on_model: MessageHandler, on_delta: MessageHandler
    ) -> None:
        self.transport = transport
        self._topics: dict[Source, tuple[str, MessageHandler]] = {
            "model": (topics.shared_model(fleet), on_model),
            "delta": (topics.model_delta(fleet), on_delta),
        }
        self.wanted: str | None = None
        self.source: Source | None = None

    def clear(self) -> None:
        """Unsubscribe from both model topics, also what a kept broker session still holds."""
        for topic, _ in self._topics.values():
            self.transport.unsubscribe(topic)
        self.source = None

    def need(self, sha: str, held: str | None, delta_base: str | None) -> bool:
        """True if the held model is `sha`; else start fetching it (the delta when it applies)."""
        if held == sha:
            return True
        self.wanted = sha
        self.fetch("delta" if held is not None and held == delta_base else "model")
        return False

    def holds_for(self, announcement: RoundAnnouncement, held: ReceivedModel | None) -> bool:
        """Whether `held` serves `announcement`'s work; if not, start fetching one that does.

        An asynchronous job takes any model from the announced one on; other work its own.
        """
        if announcement.asynchronous:
            if held is not None and held.header.round_id >= announcement.round_id - 1:
                return True
            self.latest()
            return False
        sha = None if held is None else held.header.manifest.sha256
        return self.need(announcement.model_sha256, sha, announcement.delta_base_sha256)

    def latest(self) -> None:
        """Fetch the model the coordinator retains now, whichever it is."""
        self.wanted = LATEST
        self.fetch("model")

    def fetch(self, source: Source) -> None:
        """Subscribe to `source` (and off the other one); the retained copy arrives at once."""
        if self.source == source:
            return
        self.stop()
        topic, handler = self._topics[source]
        self.source = source
        self.transport.subscribe(topic, handler)

    def arrived(self, sha: str) -> None:
        """A model arrived: stop downloading if it is the one wanted."""
        if self.wanted in (sha, LATEST):
            self.wanted = None
            self.stop()

    def stop(self) -> None:
        """Unsubscribe from the topic being fetched, if any."""
        if self.source is not None:
            self.transport.unsubscribe(self._topics[self.source][0])
            self.source = None


def rebuild_from_delta(
    held: ReceivedModel,
    delta: ModelDelta,
    blob: bytes,
    layout: Sequence[TensorSpec],
    cache: DecodedModelCache,
) -> tuple[ReceivedModel, bytes]:
    """The model `delta` leads to from `held`, as a received model and its whole frame.

    Raises:
        ProtocolError: `held` is not the delta's base, the delta does not fit the model, or the
            rebuilt model's digest is not the one the delta promised.
    """
    if held.header.manifest.sha256 != delta.base_sha256:
        msg = "the model delta starts from a model this device does not hold"
        raise ProtocolError(msg)
    base = cache.decode(held, tuple(layout))
    dense = model_delta_layout(delta.manifest.tensors, layout)
    encoded = unpack_tensors(delta.manifest, blob, expected=encoded_layout(dense, INT8))
    rebuilt = apply_model_delta(base, decode(encoded, dense, INT8))
    manifest, model_blob = pack_tensors(rebuilt)
    if manifest.sha256 != delta.target_sha256:
        msg = "the model rebuilt from the delta differs from the announced one"
        raise ProtocolError(msg)
    header = SharedModel(round_id=delta.round_id, manifest=manifest)
    return ReceivedModel(header, model_blob, rebuilt), encode_frame(header, model_blob)
