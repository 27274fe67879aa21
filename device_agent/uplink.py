"""A device's uplink: privatize -> mask | compress -> keep residual -> frame, one stage each.

Each step is a stage with a null object, chosen once per announcement from what it asks:
without DP the result leaves as trained (`RoundContexts.privatize` is the identity then);
without a lossy codec the delta travels as it is and leaves no residual (`send_as_is`);
without secure aggregation the update is framed in clear (`PlainFrame`), with it masked
(`SecureFrame`, which also does the codec's work on the ring's integers, so the compress stage
is the null one there). The round handler calls `Uplink.answer` and names no feature; what a
path needs before training (secure aggregation's keys and shares) is asked through `open` and
`ready`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from device_agent.algorithms.base import LocalResult
from device_agent.context import RoundContexts
from device_agent.replies import update_message
from device_agent.secure_aggregation import SecureClient
from protocols.codec import Tensors
from protocols.messages import DeviceUpdate, RoundAnnouncement

Privatize = Callable[[LocalResult], tuple[LocalResult, float | None]]
"""What DP lets leave of a result, and the noised within-clip bit when one is asked for."""
Compress = Callable[[Tensors], tuple[Tensors, Tensors]]
"""(what the update carries, the residual to keep) for a shared delta."""


def send_as_is(delta: Tensors) -> tuple[Tensors, Tensors]:
    """The null compress stage: the dense delta, nothing left over."""
    return dict(delta), {}


class Frame(Protocol):
    """The last stage: the update message and its blob."""

    def open(
        self, announcement: RoundAnnouncement, reason_to_skip: Callable[[], str | None]
    ) -> str | None:
        """Set up before training; a reason to decline instead (None: go on)."""

    def ready(self, announcement: RoundAnnouncement) -> bool:
        """Whether the device may train now."""

    def again(self, announcement: RoundAnnouncement) -> tuple[DeviceUpdate, bytes] | None:
        """A fresh frame of a kept answer to work announced again, if the path makes one."""

    def __call__(
        self,
        announcement: RoundAnnouncement,
        result: LocalResult,
        encoded: Tensors,
        within_clip: float | None,
    ) -> tuple[DeviceUpdate, bytes]:
        """The update of `result`, its delta already through the compress stage."""


@dataclass(frozen=True)
class PlainFrame:
    """The null secure-aggregation stage: the update in clear, nothing to set up."""

    device_id: str

    def open(
        self, announcement: RoundAnnouncement, reason_to_skip: Callable[[], str | None]
    ) -> str | None:
        """Nothing to set up."""
        return None

    def ready(self, announcement: RoundAnnouncement) -> bool:
        """Always."""
        return True

    def again(self, announcement: RoundAnnouncement) -> tuple[DeviceUpdate, bytes] | None:
        """None: the kept reply is sent again as it was."""
        return None

    def __call__(
        self,
        announcement: RoundAnnouncement,
        result: LocalResult,
        encoded: Tensors,
        within_clip: float | None,
    ) -> tuple[DeviceUpdate, bytes]:
        """The update with its encoded delta, in clear."""
        return update_message(announcement, self.device_id, result, encoded, within_clip)


@dataclass(frozen=True)
class SecureFrame:
    """Secure aggregation: keys and shares before training, then one masked vector."""

    client: SecureClient

    def open(
        self, announcement: RoundAnnouncement, reason_to_skip: Callable[[], str | None]
    ) -> str | None:
        """A training round: this device's fresh keys, unless it declines first."""
        if announcement.phase != "train":
            return None
        reason = reason_to_skip()  # said before dealing any shares
        if reason is None:
            self.client.join(announcement)
        return reason

    def ready(self, announcement: RoundAnnouncement) -> bool:
        """Once its shares are dealt."""
        return self.client.ready(announcement)

    def again(self, announcement: RoundAnnouncement) -> tuple[DeviceUpdate, bytes] | None:
        """The kept result masked with this dealing's keys."""
        return self.client.answer_again(announcement)

    def __call__(
        self,
        announcement: RoundAnnouncement,
        result: LocalResult,
        encoded: Tensors,
        within_clip: float | None,
    ) -> tuple[DeviceUpdate, bytes]:
        """One masked vector, nothing in clear."""
        return self.client.answer(announcement, result, within_clip)


@dataclass(frozen=True)
class RoundUplink:
    """One announcement's stages."""

    privatize: Privatize
    compress: Compress
    frame: Frame


class Uplink:
    """The device's uplink pipeline; `forge` is a simulated attacker's lie (identity if honest)."""

    def __init__(
        self,
        device_id: str,
        contexts: RoundContexts,
        secure: SecureClient,
        forge: Callable[[LocalResult], LocalResult],
    ) -> None:
        self.contexts = contexts
        self.secure = secure
        self.forge = forge
        self._plain = PlainFrame(device_id)
        self._masked = SecureFrame(secure)

    def stages(self, announcement: RoundAnnouncement) -> RoundUplink:
        """The stages `announcement` asks for, each a null object where it asks for nothing."""
        privatize: Privatize = partial(self.contexts.privatize, announcement)
        if announcement.secure is not None:
            return RoundUplink(privatize, send_as_is, self._masked)
        compress: Compress = send_as_is
        if announcement.uplink.lossy:
            compress = partial(self.contexts.compress, announcement)
        return RoundUplink(privatize, compress, self._plain)

    def open(
        self, announcement: RoundAnnouncement, reason_to_skip: Callable[[], str | None]
    ) -> str | None:
        """Whatever the path sets up when work is announced; a reason to decline instead."""
        return self.stages(announcement).frame.open(announcement, reason_to_skip)

    def ready(self, announcement: RoundAnnouncement) -> bool:
        """Whether the path lets the device train on `announcement` now."""
        return self.stages(announcement).frame.ready(announcement)

    def again(self, announcement: RoundAnnouncement) -> tuple[DeviceUpdate, bytes] | None:
        """The path's fresh answer to work announced again (None: the plain reply is re-sent)."""
        return self.stages(announcement).frame.again(announcement)

    def answer(
        self, announcement: RoundAnnouncement, trained: LocalResult
    ) -> tuple[DeviceUpdate, bytes]:
        """The update of a trained result, through every stage; personal state kept on the way.

        Raises:
            PflError: a stage refused (e.g. no dealt shares), or the state could not be kept.
        """
        stages = self.stages(announcement)
        result, within_clip = stages.privatize(trained)
        result = self.forge(result)
        encoded, residual = stages.compress(result.shared_delta)
        self.contexts.keep(announcement, result, residual)
        return stages.frame(announcement, result, encoded, within_clip)
