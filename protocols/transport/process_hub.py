"""An in-process hub that also serves clients living in worker processes.

The parent's hub stays the only broker: a worker's devices subscribe here through their link, so
retained messages and per-subscriber order are what one process would see. One delivery goes
down each worker's pipe once, naming the subscriptions it is for. While the hub has nothing
queued it waits for the workers' frames, up to the caller's timeout, which is the one place
where time passes in a simulation.
"""

from __future__ import annotations

import logging
import math
import queue
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from protocols.errors import RoundError
from protocols.transport.inprocess import (
    InProcessBroker,
    InProcessTransport,
    _Delivery,
    _Subscription,
)
from protocols.transport.process_link import (
    CLOSE,
    CONNECT,
    DELIVER,
    KEEP,
    KEEP_MIN_BYTES,
    KEPT,
    PUBLISH,
    REPLY,
    REQUEST,
    STOP,
    SUBSCRIBE,
    SYNC,
    SYNCED,
    UNSUBSCRIBE,
    Frame,
    decode_link_frame,
    encode_link_frame,
)

logger = logging.getLogger(__name__)
_DIRECT_MAX_BYTES = getattr(select, "PIPE_BUF", 512) - 4
"""An atomic write to a pipe, less the 4-byte length prefix of a frame."""


class WorkerLink:
    """The hub's end of one worker: its pipes, a writer thread, and a client per device."""

    def __init__(self, index: int, down: Connection, up: Connection, process: BaseProcess):
        self.index = index
        self.up = up
        self.clients: dict[int, InProcessTransport] = {}
        self.replies: list[Frame] = []
        self.kept: dict[str, bytes] = {}
        """The retained payload the worker keeps per topic, so it goes down the pipe once."""
        self._down = down
        self._process = process
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._queued = 0  # counted by the hub's thread only
        self._written = 0  # counted by the writer only: the difference is what it still holds

    def start(self) -> None:
        """Start writing: sends never block the hub, so two full pipes cannot deadlock."""
        self._writer = threading.Thread(target=self._write, name=f"link-{self.index}", daemon=True)
        self._writer.start()

    def send(self, frame: Frame) -> None:
        """Send `frame` to the worker now if that cannot block, else queue it for the writer.

        A write of at most PIPE_BUF bytes to a pipe that polls writable completes at once; most
        frames are that small, and handing each to the writer thread cost a thread switch.
        """
        data = encode_link_frame(frame)
        if (
            self._queued == self._written
            and len(data) <= _DIRECT_MAX_BYTES
            and select.select([], [self._down], [], 0)[1]
        ):
            self._down.send_bytes(data)
            return
        self._queued += 1
        self._outbox.put(data)

    def stop(self) -> None:
        """Ask the worker to stop after what is queued, then make sure it is gone."""
        self._queued += 1  # in order after everything queued: never sent directly
        self._outbox.put(encode_link_frame(Frame(STOP, {})))
        self._outbox.put(None)
        if self._writer is not None:
            self._writer.join(timeout=10.0)
        self._process.join(timeout=10.0)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=5.0)

    def failure(self) -> RoundError:
        """The error for a worker that went away."""
        self._process.join(timeout=5.0)  # its pipe closed as it died: reap it for the code
        return RoundError(
            f"simulation worker {self.index} stopped unexpectedly (exit code "
            f"{self._process.exitcode}); its log lines above say why"
        )

    def _write(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self._down.send_bytes(data)
            except OSError:  # the worker is gone; the hub notices on its side of the pipe
                return
            self._written += 1


@dataclass(eq=False)
class _RemoteSubscription(_Subscription):
    link: WorkerLink | None = None
    remote_id: int = 0


def _never(topic: str, payload: bytes) -> None:  # remote subscriptions go down their link
    raise AssertionError(topic)


@dataclass
class ProcessHub(InProcessBroker):
    """The in-process hub plus the clients of worker processes behind `links`."""

    links: list[WorkerLink] = field(default_factory=list)
    _readable: Any = None  # one select.poll over the links' readers, kept between waits
    _by_fd: dict[int, WorkerLink] = field(default_factory=dict)

    def pump(self, predicate: Callable[[], bool], timeout_s: float | None = None) -> bool:
        """Deliver, and wait for the workers, until `predicate()` holds or `timeout_s` passes."""
        if self._dispatching:
            return predicate()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._dispatching = True
        try:
            while not predicate():
                if self._queue or self._run_idle():
                    self._deliver(self._queue.popleft())
                    continue
                remaining = None if deadline is None else deadline - time.monotonic()
                if not self.links or (remaining is not None and remaining <= 0):
                    break
                self.receive(remaining)
        finally:
            self._dispatching = False
        return predicate()

    def receive(self, timeout_s: float | None) -> int:
        """Take in the frames the workers sent, waiting up to `timeout_s` for the first.

        Raises:
            RoundError: a worker went away.
        """
        if len(self._by_fd) != len(self.links):  # links are added before the first round
            self._by_fd = {link.up.fileno(): link for link in self.links}
            self._readable = select.poll()
            for fd in self._by_fd:
                self._readable.register(fd, select.POLLIN)
        taken = 0
        wait_ms = None if timeout_s is None else max(0, math.ceil(timeout_s * 1000))
        ready: list[tuple[int, int]] = self._readable.poll(wait_ms)
        while ready:  # one frame per readable link, then ask the kept poll object again
            for fd, _ in ready:
                link = self._by_fd[fd]
                try:
                    self._accept(link, decode_link_frame(link.up.recv_bytes()))
                except (EOFError, OSError):
                    raise link.failure() from None
                taken += 1
            ready = self._readable.poll(0)
        return taken

    def quiesce(self, timeout_s: float) -> tuple[int, int]:
        """Let every message in flight arrive; the bytes the workers' devices sent and received.

        Quiet means: nothing queued here, and a sync round trip to every worker brought no
        frame but its answer (a worker answers after everything it was sent before).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            InProcessBroker.pump(self, lambda: False)
            for link in self.links:
                link.send(Frame(SYNC, {}))
            answers, taken = self._collect(SYNCED, deadline, timeout_s)
            if taken == len(self.links) and not self._queue:
                sent = sum(int(a.header["sent"]) for a in answers)
                return sent, sum(int(a.header["received"]) for a in answers)

    def request(self, header: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
        """Ask every worker to do something (e.g. export its devices); their answers, in order."""
        for link in self.links:
            link.send(Frame(REQUEST, header))
        answers, _ = self._collect(REPLY, time.monotonic() + timeout_s, timeout_s)
        return [answer.header for answer in answers]

    def _collect(self, kind: bytes, deadline: float, timeout_s: float) -> tuple[list[Frame], int]:
        """One `kind` answer from every link, in link order, and how many frames came in."""
        taken = 0
        while any(not any(f.kind == kind for f in link.replies) for link in self.links):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                msg = f"simulation workers did not answer within {timeout_s:.0f} s"
                raise RoundError(msg)
            taken += self.receive(remaining)
        answers = []
        for link in self.links:
            answer = next(f for f in link.replies if f.kind == kind)
            link.replies.remove(answer)
            answers.append(answer)
        return answers, taken

    def _accept(self, link: WorkerLink, frame: Frame) -> None:
        header = frame.header
        if frame.kind in (SYNCED, REPLY):
            if "error" in header:
                msg = f"simulation worker {link.index}: {header['error']}"
                raise RoundError(msg)
            link.replies.append(frame)
            return
        if frame.kind == CONNECT:
            link.clients[header["d"]] = self.connect(header["id"])
            return
        client = link.clients[header["d"]]
        if frame.kind == PUBLISH:
            client.publish(header["t"], frame.payload, retain=bool(header["r"]))
        elif frame.kind == SUBSCRIBE:
            subscription = _RemoteSubscription(
                header["p"], _never, client, link=link, remote_id=header["s"]
            )
            client._subscriptions.setdefault(subscription.pattern, []).append(subscription)
            self._subscribe(subscription)
        elif frame.kind == UNSUBSCRIBE:
            client.unsubscribe(header["p"])
        elif frame.kind == CLOSE:
            client.close()
        else:
            msg = f"simulation worker {link.index} sent a frame of unknown kind {frame.kind!r}"
            raise RoundError(msg)

    def _deliver(self, delivery: _Delivery) -> None:
        remote: dict[WorkerLink, list[int]] = {}
        for subscription in self._targets(delivery):
            if not subscription.active:
                continue
            if isinstance(subscription, _RemoteSubscription) and subscription.link is not None:
                remote.setdefault(subscription.link, []).append(subscription.remote_id)
                self.delivered[delivery.topic] += len(delivery.payload)
            else:
                self._hand(subscription, delivery.topic, delivery.payload)
        for link, subscriptions in remote.items():
            link.send(self._delivery_frame(link, delivery, subscriptions))

    def _delivery_frame(
        self, link: WorkerLink, delivery: _Delivery, subscriptions: list[int]
    ) -> Frame:
        """A delivery for `link`: a retained model the worker already keeps goes by reference.

        Every selected device fetches the retained model; without this each of a worker's
        devices would receive its own copy down the pipe.
        """
        topic, payload = delivery.topic, delivery.payload
        header: dict[str, Any] = {"t": topic, "s": subscriptions}
        if len(payload) < KEEP_MIN_BYTES:
            return Frame(DELIVER, header, payload)
        if link.kept.get(topic) is payload:
            return Frame(DELIVER, {**header, "k": KEPT}, b"")
        if self._retained.get(topic) is payload:
            link.kept[topic] = payload
            return Frame(DELIVER, {**header, "k": KEEP}, payload)
        return Frame(DELIVER, header, payload)
