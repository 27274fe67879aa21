"""`pfl-agent pool`: many virtual devices of a simulated fleet as real MQTT clients, one process.

Pools on several machines, each with its own `--devices` range, against one broker and one
`pfl-coord serve`, are a simulation spread over machines: the same agents and data as
`pfl-coord simulate`, over a real network. Each device is its own MQTT client (own id, will
and status); their handlers take turns, so they share one workspace model.
"""

from __future__ import annotations

import logging
import threading

from device_agent.coordinator_watch import CoordinatorWatch
from device_agent.settings import PoolSettings
from device_agent.virtual_fleet import VirtualFleet
from pfl_tasks.registry import load_task
from protocols.program_options import stop_on_signals
from protocols.start_line import start_line
from protocols.transport.base import Transport, Will
from protocols.transport.factory import connect
from protocols.transport.mqtt import BrokerConnectionError, MqttTransport

logger = logging.getLogger(__name__)

CONNECT_ATTEMPTS = 5
"""Tries per device: a broker taking hundreds of connections at once may answer a CONNACK late,
and one slow answer must not stop the whole pool."""

MAX_POOL_DEVICES = 300
"""Devices one pool holds. Each MQTT client's network loop waits with select(), which takes only
file descriptors below 1024, and each client holds three (its socket and a wake-up pair): past
about 330 clients a process's next connect never sees its CONNACK."""


def run_pool(settings: PoolSettings, stop: threading.Event | None = None) -> None:
    """Serve rounds with every device of the pool until `stop` is set (or SIGTERM/SIGINT).

    Raises:
        ValueError: unknown task, a range outside the fleet, or more than MAX_POOL_DEVICES.
        BrokerConnectionError: the broker cannot be reached.
    """
    if len(settings.device_range()) > MAX_POOL_DEVICES:
        msg = (
            f"--devices {settings.devices}: a pool holds at most {MAX_POOL_DEVICES} devices (each "
            "MQTT client's select() loop needs file descriptors below 1024); split the range "
            "over more pools"
        )
        raise ValueError(msg)
    stop = stop_on_signals(stop or threading.Event())
    fleet = VirtualFleet.create(
        fleet=settings.fleet,
        task=load_task(settings.task, settings.task_options),
        devices=settings.num_shards,
        partition=settings.partition_spec(),
        seed=settings.seed,
        stateful=not settings.stateless,
    )
    broker = settings.broker_settings(settings.broker)
    transports: list[MqttTransport] = []

    def connect_device(device_id: str, will: Will) -> Transport:
        for attempt in range(1, CONNECT_ATTEMPTS + 1):
            try:
                transport = connect(broker, device_id, will, clean_start=True)
                break
            except BrokerConnectionError as error:
                if attempt == CONNECT_ATTEMPTS:
                    raise
                logger.warning(
                    "%s: %s; try %d of %d", device_id, error, attempt + 1, CONNECT_ATTEMPTS
                )
        transports.append(transport)
        return transport

    agents = []
    try:
        indices = settings.device_range()
        threads = fleet.step_threads(indices, settings.thread_ceiling())
        agents = fleet.build(indices, connect_device, threaded=True, threads=threads)
        pool = f"pool of {len(agents)} devices ({settings.devices})"
        logger.info("%s", start_line(pool, settings.broker, settings.fleet, settings.username))
        watch = CoordinatorWatch(pool, settings.fleet, settings.broker).listen(transports[0])
        watch.watch_until(stop)
    finally:
        for agent in agents:
            agent.stop()
        for transport in transports[len(agents) :]:  # connected, but its agent never started
            transport.close()
        logger.info("pool of %d devices stopped", len(agents))
