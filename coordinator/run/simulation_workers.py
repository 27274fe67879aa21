"""Simulation on every core: the virtual devices run in worker processes, the coordinator here.

Workers are forked after the fleet's data is built, so they read it from pages the OS shares
instead of copying it N times. Each worker gets an even share of the devices by training
samples (`balanced_shares`); its devices share one workspace and handle their messages one at a
time, exactly as in one process. The parent's hub remains the only broker (see
`protocols.transport.process_hub`), and the coordinator aggregates in device order, so a run's
results do not depend on N.
"""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from device_agent.agent import DeviceAgent
from device_agent.batched.trainer import Batched
from device_agent.compute_threads import available_cores, useful_threads
from device_agent.exporting import export_fleet
from device_agent.virtual_fleet import VirtualFleet
from protocols.errors import describe
from protocols.transport.process_hub import ProcessHub, WorkerLink
from protocols.transport.process_link import (
    DELIVER,
    REPLY,
    REQUEST,
    STOP,
    SYNC,
    SYNCED,
    Frame,
    WorkerEnd,
    decode_link_frame,
)

logger = logging.getLogger(__name__)
ANSWER_TIMEOUT_S = 3600.0
"""How long the parent waits for workers to finish what it asked (an export of 10,000 models)."""


def worker_count(requested: int, devices: int) -> int:
    """`requested` workers (0: one per available core), never more than there are devices.

    Raises:
        ValueError: more than one asked for where processes cannot be forked (Windows).
    """
    if "fork" not in multiprocessing.get_all_start_methods():
        if requested > 1:
            msg = "--workers needs the fork start method, which this platform lacks: use 1"
            raise ValueError(msg)
        return 1
    return max(1, min(requested or available_cores(), devices))


def threads_per_worker(workers: int, step_macs: int) -> int:
    """Torch intra-op threads for each of `workers` processes training steps of `step_macs`.

    Together no more than the cores; fewer where the model is too small to gain from them.
    """
    return useful_threads(step_macs, max(1, available_cores() // workers))


def balanced_shares(work: Sequence[int], workers: int) -> list[list[int]]:
    """Device indices for each worker, so that their summed `work` (e.g. samples) is even.

    Round-robin left one worker of two 3.5% more samples than the other on synthetic's
    power-law fleet, and every round waited for it. Largest first to the least loaded worker
    (ties: the lower index): deterministic, within the largest device of the even split.
    """
    shares: list[list[int]] = [[] for _ in range(workers)]
    loads = [0] * workers
    for index in sorted(range(len(work)), key=lambda i: (-work[i], i)):
        lightest = min(range(workers), key=lambda w: (loads[w], w))
        shares[lightest].append(index)
        loads[lightest] += work[index]
    return [sorted(share) for share in shares]


class WorkerDevices:
    """Virtual devices in worker processes, reached through `hub`."""

    def __init__(
        self,
        hub: ProcessHub,
        fleet: VirtualFleet,
        devices: int,
        workers: int,
        threads: int,
        batched: bool = False,
    ) -> None:
        """Fork `workers` processes for devices 0..devices-1, each with `threads` torch threads.

        `batched`: each worker trains its devices' updates of a round together (`Batched`).
        """
        self.hub = hub
        self.agents: list[DeviceAgent] = []  # they live in the workers
        context = multiprocessing.get_context("fork")
        inherited: list[Connection] = []
        shares = balanced_shares([len(data.train) for data in fleet.data[:devices]], workers)
        for index, share in enumerate(shares):
            down_reader, down_writer = context.Pipe(duplex=False)
            up_reader, up_writer = context.Pipe(duplex=False)
            inherited += [down_writer, up_reader]
            process = context.Process(
                target=_worker_main,
                args=(fleet, share, threads, down_reader, up_writer),
                kwargs={"inherited": tuple(inherited), "batched": batched},
                name=f"pfl-sim-worker-{index}",
                daemon=True,
            )
            process.start()
            down_reader.close()
            up_writer.close()
            hub.links.append(WorkerLink(index, down_writer, up_reader, process))
        for link in hub.links:  # threads only after the last fork
            link.start()

    def settle(self) -> tuple[int, int]:
        """Let the messages in flight arrive; payload bytes all devices sent and received."""
        return self.hub.quiesce(ANSWER_TIMEOUT_S)

    def export(self, directory: Path, *, quantize: str | None, guard: bool) -> dict[str, Any]:
        """Every device's personalized model exported and verified by its worker."""
        ask = {"export": {"dir": str(directory), "quantize": quantize, "guard": guard}}
        return merge_exports([a["export"] for a in self.hub.request(ask, ANSWER_TIMEOUT_S)])

    def close(self) -> None:
        """Stop the workers (they finish what they hold), then make sure they are gone."""
        for link in self.hub.links:
            link.stop()


def merge_exports(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One summary "export" entry from the workers' entries."""
    failures: dict[str, str] = {}
    for part in parts:
        failures.update(part["failures"])
    return {
        "dir": parts[0]["dir"],
        "ok": sum(int(part["ok"]) for part in parts),
        "failed": len(failures),
        "failures": dict(sorted(failures.items())),
        "total_bytes": sum(int(part["total_bytes"]) for part in parts),
        "shipped_global": sum(int(part["shipped_global"]) for part in parts),
    }


def _worker_main(
    fleet: VirtualFleet,
    indices: list[int],
    threads: int,
    down: Connection,
    up: Connection,
    *,
    inherited: tuple[Connection, ...],
    batched: bool = False,
) -> None:
    for connection in inherited:  # the parent's ends: the parent alone must hold them
        connection.close()
    torch.set_num_threads(threads)
    end = WorkerEnd(up)
    trainer = Batched() if batched else None
    try:
        agents = fleet.build(
            indices, lambda device, will: end.connect(device), threaded=False, trainer=trainer
        )
        while True:
            frame = decode_link_frame(down.recv_bytes())
            if frame.kind == DELIVER:
                end.deliver(frame)
                if trainer is not None and not down.poll():
                    trainer.flush()  # nothing more to hand out now: train what was handed
                continue
            if trainer is not None:
                trainer.flush()
            if frame.kind == SYNC:
                sent, received = end.traffic()
                end.send(Frame(SYNCED, {"sent": sent, "received": received}))
            elif frame.kind == REQUEST:
                end.send(Frame(REPLY, _answer(agents, frame.header)))
            elif frame.kind == STOP:
                return
    except EOFError:  # the parent went away
        return
    except Exception as error:
        logger.exception("simulation worker for devices %s failed", indices)
        end.send(Frame(REPLY, {"error": describe(error)}))


def _answer(agents: list[DeviceAgent], request: dict[str, Any]) -> dict[str, Any]:
    options = request["export"]
    exported = export_fleet(
        [agent.exports.source() for agent in agents],
        Path(options["dir"]),
        quantize=options["quantize"],
        guard=bool(options["guard"]),
    )
    return {"export": exported}
