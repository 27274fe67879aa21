"""One device's valid credentials against a real coordinator on mosquitto with the generated ACL.

Three honest agent processes and `serve` (TLS, per-account passwords, the ACL, client ids bound
to user names) run a FedAvg fleet; an attacker holding the credentials of a fourth provisioned
device attacks each run with one class of attack. For every class: the run completes, every
honest device answers every round, and the final model is finite and equal to a simulation
without the attacker, or, where the attack only changes weights and norms, within the bound
docs/security.md promises. The table there lists these classes and their outcomes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coordinator.engine.silence import SilentDevices
from coordinator.ops.broker_config import BrokerLimits
from coordinator.ops.status import collect_fleet_view
from coordinator.run.pipeline import RunResult
from coordinator.run.serve import run_serve
from coordinator.run.settings import ServeSettings, SimulationSettings
from coordinator.run.simulate import device_name, run_simulation
from coordinator.stages.aggregate_guard import GuardSettings
from coordinator.stages.secure.aggregator import SHORT_PHASES
from device_agent.agent import device_will
from device_agent.capabilities import probe_capabilities
from device_agent.secure_aggregation import SecureClient
from pfl_tasks.registry import load_task
from protocols import compression, topics
from protocols.codec import decode_frame, encode_frame, pack_tensors
from protocols.compression import INT8
from protocols.messages import (
    Command,
    DeviceHello,
    DeviceStatus,
    DeviceUpdate,
    EvaluationReport,
    Message,
    RoundAnnouncement,
    SecAggKeys,
    SharedModel,
)
from protocols.secure_aggregation import MASKED_TENSOR
from protocols.transport import chunking
from protocols.transport.mqtt import MqttTransport
from protocols.transport.settings import BrokerSettings
from tests.conftest import free_port
from tests.e2e.conftest import Processes
from tests.forged_views import forged_views, strict_json
from tests.integration.test_broker_limits import Client as RawClient
from tests.provisioned import ProvisionedBroker, start_provisioned
from tests.run_metrics import metrics_lines

pytestmark = [pytest.mark.mosquitto, pytest.mark.timeout(240)]
FLEET = "lab"
EVIL = "evil"
HONEST = 3
ROUNDS = 2
RUN = {"task": "digits", "algorithm": "fedavg", "seed": 0}
GUARD = GuardSettings()


@dataclass
class Fleet:
    """The provisioned broker and the honest agent processes, shared by every attack."""

    broker: ProvisionedBroker
    processes: Processes
    directory: Path
    runs: int = 0

    @property
    def url(self) -> str:
        return self.broker.url

    def serve(
        self, rounds: int, min_devices: int = HONEST, **options: Any
    ) -> tuple[RunResult, list[dict[str, Any]]]:
        """One fresh run of `pfl-coord serve` (more `options` of it); result, metrics lines."""
        self.runs += 1
        out = self.directory / f"run-{self.runs}"
        settings = ServeSettings.load(
            None,
            **RUN,
            **self.broker.coordinator_options(),
            fleet=FLEET,
            rounds=rounds,
            min_devices=min_devices,
            round_timeout=30.0,
            join_timeout=90.0,
            out=out / "run",
            checkpoint_dir=out / "checkpoint",
            **options,
        )
        return run_serve(settings), metrics_lines(out / "run")

    def dropped(self) -> dict[str, tuple[int, bool]]:
        """Each device's dropped count and quarantine flag, as `pfl-coord status` shows them."""
        operator = self.broker.account("operator")
        view = collect_fleet_view(
            self.broker.settings(operator.username, operator.password), FLEET, listen_s=1.0
        )
        assert view.fleet is not None
        return {d.device_id: (d.dropped, d.quarantined) for d in view.fleet.devices}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    directory = tmp_path_factory.mktemp("adversary")
    honest = [device_name(index) for index in range(HONEST)]
    broker = start_provisioned(directory / "deploy", [*honest, EVIL], FLEET)
    processes = Processes(directory)
    try:
        for index, device_id in enumerate(honest):
            credential = broker.account(device_id)
            processes.agent(
                f"mqtts://127.0.0.1:{broker.tls_port}",
                index,
                shards=HONEST,
                extra=(
                    "--fleet", FLEET,
                    "--username", credential.username,
                    "--password", credential.password,
                    "--ca-file", str(broker.result.files["ca.crt"]),
                ),
            )  # fmt: skip
        yield Fleet(broker, processes, directory)
    finally:
        processes.stop_all()
        broker.stop()


@pytest.fixture(scope="module")
def clean() -> dict[int, RunResult]:
    """The runs without an attacker, by number of rounds (serve + agents equal simulation)."""
    return {
        rounds: run_simulation(
            SimulationSettings.load(None, **RUN, devices=HONEST, rounds=rounds, batched="off")
        )
        for rounds in (1, ROUNDS)
    }


# -- the attacker ----------------------------------------------------------------------------


@dataclass
class Attacker:
    """An MQTT client with the `evil` device's credentials, reacting to every announcement."""

    fleet: Fleet
    on_round: Callable[[Attacker, RoundAnnouncement], None] | None = None
    joined: int | None = None  # the sample count it joined with
    seen: list[RoundAnnouncement] = field(default_factory=list)
    transport: MqttTransport | None = None

    def __enter__(self) -> Attacker:
        self.transport = MqttTransport(attacker_settings(self.fleet), EVIL)
        self.transport.subscribe(topics.round_announcement(FLEET), self._on_announcement)
        self.transport.subscribe(topics.command(FLEET), self._on_command)
        return self

    def __exit__(self, *exc_info: object) -> None:
        assert self.transport is not None
        self.transport.close()

    def send(self, kind: topics.DeviceTopicKind, payload: bytes, device: str = EVIL) -> None:
        assert self.transport is not None
        self.transport.publish(topics.device(FLEET, device, kind), payload)

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        assert self.transport is not None
        self.transport.publish(topic, payload, retain=retain)

    def hello(self, samples: int) -> None:
        """Join the fleet (again whenever a coordinator asks): rounds then wait for `evil`."""
        hello = DeviceHello(
            device_id=EVIL,
            task="digits",
            num_train_samples=samples,
            capabilities=probe_capabilities(),
        )
        self.send("hello", encode_frame(hello))
        self.joined = samples

    def decline(self, announcement: RoundAnnouncement) -> None:
        """What keeps an attacker that joined from costing each round its deadline."""
        status = DeviceStatus(
            device_id=EVIL,
            state="skipped",
            round_id=announcement.round_id,
            run_id=announcement.run_id,
        )
        self.send("status", encode_frame(status))

    def _on_announcement(self, _topic: str, payload: bytes) -> None:
        announcement, _ = decode_frame(payload)
        assert isinstance(announcement, RoundAnnouncement)
        self.seen.append(announcement)
        if announcement.phase == "train" and self.on_round is not None:
            self.on_round(self, announcement)
        elif self.joined is not None and announcement.phase != "train":
            self.decline(announcement)

    def _on_command(self, _topic: str, payload: bytes) -> None:
        command, _ = decode_frame(payload)
        if isinstance(command, Command) and command.action == "hello" and self.joined is not None:
            self.hello(self.joined)


def attacker_settings(fleet: Fleet) -> BrokerSettings:
    """The `evil` account's; it never gives its id up (its own connections displace it)."""
    credential = fleet.broker.account(EVIL)
    return fleet.broker.settings(credential.username, credential.password, max_takeovers=0)


def _header(frame: bytes) -> bytes:
    length = int.from_bytes(frame[4:8], "big")
    return frame[8 : 8 + length]


def update(
    announcement: RoundAnnouncement,
    tensors: dict[str, torch.Tensor],
    *,
    samples: int = 10,
    device: str = EVIL,
    **changes: object,
) -> bytes:
    """A well-formed DeviceUpdate frame answering `announcement` (fields overridable)."""
    manifest, blob = pack_tensors(tensors)
    fields: dict[str, object] = {
        "run_id": announcement.run_id,
        "round_id": announcement.round_id,
        "device_id": device,
        "algorithm": announcement.algorithm,
        "num_samples": samples,
        "train_loss": 0.5,
        "manifest": manifest,
    }
    fields.update(changes)
    return encode_frame(DeviceUpdate.model_validate(fields), blob)


def raw_update(header: dict[str, object], blob: bytes) -> bytes:
    """A frame whose header the sender's codec would refuse to write (bounds, NaN)."""
    body = json.dumps(header).encode()
    return b"PFL\x01" + len(body).to_bytes(4, "big") + body + blob


def shared_like(fill: float) -> dict[str, torch.Tensor]:
    """Tensors of the shared model's exact layout, every value `fill`."""
    model = load_task("digits").build_model(0)
    return {name: torch.full_like(value, fill) for name, value in model.state_dict().items()}


# -- the attacks -----------------------------------------------------------------------------


def counts(attacker: Attacker, announcement: RoundAnnouncement) -> None:
    """Absurd sample counts: past the wire bound, past --max-samples, past its own hello."""
    header = json.loads(_header(update(announcement, shared_like(0.0))))
    header["num_samples"] = 10**30
    attacker.send("update", raw_update(header, b""))
    hello = json.loads(
        DeviceHello(
            device_id=EVIL, task="digits", num_train_samples=1, capabilities=probe_capabilities()
        ).model_dump_json()
    )
    hello["num_train_samples"] = 10**15
    attacker.send("hello", raw_update(hello, b""))
    attacker.hello(GUARD.max_samples + 1)
    attacker.send("update", update(announcement, shared_like(1.0), samples=10**9))


def non_finite(attacker: Attacker, announcement: RoundAnnouncement) -> None:
    """NaN and Inf in the deltas (checksums matching) and in the scalars."""
    tensors = shared_like(0.0)
    _, blob = pack_tensors(tensors)
    poisoned = bytearray(blob)
    poisoned[-4:] = bytes.fromhex("0000c07f")  # the last float becomes a float32 NaN
    header = json.loads(_header(update(announcement, tensors)))
    header["manifest"]["sha256"] = hashlib.sha256(bytes(poisoned)).hexdigest()
    attacker.send("update", raw_update(header, bytes(poisoned)))
    header = json.loads(_header(update(announcement, tensors)))
    header["train_loss"] = "NaN"
    attacker.send("update", raw_update(header, blob))
    header = json.loads(_header(update(announcement, tensors)))
    header["scalars"] = {"sigma2": 1e300}
    attacker.send("update", raw_update(header, blob))
    attacker.decline(announcement)


def stale_and_future(attacker: Attacker, announcement: RoundAnnouncement) -> None:
    """Answers for the round before, long after and the same round of another run."""
    for round_id in (announcement.round_id - 1, announcement.round_id + 1, 10**9):
        attacker.send("update", update(announcement, shared_like(1.0), round_id=round_id))
    attacker.send("update", update(announcement, shared_like(1.0), run_id="0" * 32))
    attacker.decline(announcement)


def shapes(attacker: Attacker, announcement: RoundAnnouncement) -> None:
    """Wrong tensor names, shapes and dtypes, and a payload far past the size limit."""
    good = shared_like(0.0)
    name = next(iter(good))
    attacker.send("update", update(announcement, {**good, name: torch.zeros(7)}))
    attacker.send("update", update(announcement, {**good, "extra": torch.zeros(3)}))
    attacker.send("update", update(announcement, {**good, name: good[name].double()}))
    attacker.send("update", os.urandom(64) * 4096)
    attacker.decline(announcement)


def impersonation(attacker: Attacker, announcement: RoundAnnouncement) -> None:
    """Another device's name in its own messages, and another device's topics (ACL-denied)."""
    victim = device_name(0)
    attacker.send("update", update(announcement, shared_like(5.0), device=victim))
    attacker.send("update", update(announcement, shared_like(5.0), device=victim), device=victim)
    status = DeviceStatus(device_id=victim, state="offline")
    attacker.send("status", encode_frame(status), device=victim)
    attacker.decline(announcement)


def forgery(attacker: Attacker, announcement: RoundAnnouncement) -> None:
    """Oversized work and a forged model and commands on the coordinator's topics (ACL)."""
    forged = announcement.model_copy(update={"config": {"local_epochs": 10**6}})
    attacker.publish(topics.round_announcement(FLEET), encode_frame(forged), retain=True)
    manifest, blob = pack_tensors(shared_like(100.0))
    model = SharedModel(round_id=announcement.round_id, manifest=manifest)
    attacker.publish(topics.shared_model(FLEET), encode_frame(model, blob), retain=True)
    for action in ("reset-state", "shutdown"):
        attacker.publish(topics.command(FLEET), encode_frame(Command(action=action)))
    attacker.decline(announcement)


def malformed(attacker: Attacker, announcement: RoundAnnouncement) -> None:
    """Bytes that are no frame at all, on every topic of its own."""
    for kind in topics.DEVICE_TOPIC_KINDS:
        for payload in (b"", b"PFL", b"PFL\x01\xff\xff\xff\xff", os.urandom(300)):
            attacker.send(kind, payload)  # type: ignore[arg-type]
    attacker.decline(announcement)


def flood(attacker: Attacker, announcement: RoundAnnouncement) -> None:
    """Thousands of tiny messages and of chunked transfers that never complete."""
    if announcement.round_id != 1:
        attacker.decline(announcement)
        return
    chunk = chunking.split(os.urandom(600), 200)[0]
    update_topic = topics.device(FLEET, EVIL, "update")
    for index in range(3000):
        attacker.publish(topics.chunk_topic(update_topic, 0), chunk)
        attacker.send("status", b"x" * (index % 50))
    attacker.decline(announcement)


def retained_flood(attacker: Attacker, announcement: RoundAnnouncement) -> None:
    """Retained messages on new names under its own subtree, and one packet past the limit."""
    if announcement.round_id == 1:
        status = topics.device(FLEET, EVIL, "status")
        update_topic = topics.device(FLEET, EVIL, "update")
        for index in range(300):
            attacker.publish(f"{status}/{index}", b"x" * 1000, retain=True)
            chunk_index = BrokerLimits().max_chunks + index
            attacker.publish(topics.chunk_topic(update_topic, chunk_index), b"x", retain=True)
        raw = RawClient(attacker.fleet.broker, EVIL)  # one packet, not split into chunks
        raw.client.publish(status, b"x" * (BrokerLimits().max_packet_bytes + 1), retain=True)
        raw.disconnected.wait(10)
        raw.close()
    attacker.decline(announcement)


def takeover(attacker: Attacker, announcement: RoundAnnouncement) -> None:
    """Connections under the coordinator's and a device's client ids, each round."""
    for client_id in (f"pfl-coord-{FLEET}", "pfl-coordinator", device_name(1)):
        MqttTransport(attacker_settings(attacker.fleet), client_id).abort()
    attacker.decline(announcement)


def weights(attacker: Attacker, announcement: RoundAnnouncement) -> None:
    """A delta under the clip (norm 12, honest ones are 1-2) with a huge but allowed count.

    Uncapped it would all but replace the aggregate; the weight cap halves it.
    """
    tensors = shared_like(1.0)
    scale = 12.0 / math.sqrt(sum(t.numel() for t in tensors.values()))
    tensors = {name: value * scale for name, value in tensors.items()}
    attacker.send("update", update(announcement, tensors, samples=GUARD.max_samples))


def norms(attacker: Attacker, announcement: RoundAnnouncement) -> None:
    """An enormous but finite delta: the norm clip bounds it."""
    attacker.send("update", update(announcement, shared_like(1e6), samples=10))


NO_EFFECT = {
    "counts": counts,
    "non-finite": non_finite,
    "stale-and-future-rounds": stale_and_future,
    "shapes-and-sizes": shapes,
    "impersonation": impersonation,
    "forgery-and-oversized-work": forgery,
    "malformed-frames": malformed,
    "flood": flood,
    "id-takeover": takeover,
    "retained-flood": retained_flood,
}
BOUNDED = {"weights": (weights, GUARD.max_samples), "norms": (norms, 10)}


def _assert_equal(result: RunResult, reference: RunResult) -> None:
    for name, tensor in reference.final_shared.items():
        assert bool(torch.isfinite(result.final_shared[name]).all()), name
        assert torch.equal(result.final_shared[name], tensor), name


@pytest.mark.parametrize("attack", list(NO_EFFECT))
def test_an_attack_changes_nothing(fleet: Fleet, clean: dict[int, RunResult], attack: str) -> None:
    with Attacker(fleet, NO_EFFECT[attack]) as attacker:
        members = HONEST
        if attack != "counts":
            attacker.hello(10)  # a member of the fleet: its answers reach the deepest checks
            members += 1
        result, lines = fleet.serve(ROUNDS, min_devices=members)
    assert [line["participants"] for line in lines] == [HONEST] * ROUNDS
    _assert_equal(result, clean[ROUNDS])
    log = fleet.broker.log.read_text()
    assert "Client pfl-coordinator already connected" not in log
    for index in range(HONEST):
        assert f"Client {device_name(index)} already connected" not in log
    if attack in ("forgery-and-oversized-work", "impersonation"):
        assert f"Denied PUBLISH from {EVIL}" in log
    elif attack == "retained-flood":  # nothing of it stayed on the broker but its own status
        assert f"Denied PUBLISH from {EVIL}" in log
        watcher = RawClient(fleet.broker, "coordinator")
        stored = watcher.retained_under(topics.device_subtree(FLEET, EVIL))
        watcher.close()
        assert set(stored) <= {topics.device(FLEET, EVIL, "status")}, sorted(stored)[:5]
    elif attack != "id-takeover":
        assert fleet.dropped()[EVIL][0] > 0


@pytest.mark.parametrize("attack", list(BOUNDED))
def test_an_attack_on_weights_or_norms_stays_within_the_bound(
    fleet: Fleet, clean: dict[int, RunResult], attack: str
) -> None:
    send, samples = BOUNDED[attack]
    with Attacker(fleet, send) as attacker:
        attacker.hello(samples)
        result, lines = fleet.serve(1, min_devices=HONEST + 1)
    (line,) = lines
    assert line["participants"] == HONEST + 1
    reference = clean[1].final_shared
    distance = math.sqrt(
        sum(
            float((result.final_shared[k].double() - v.double()).pow(2).sum())
            for k, v in reference.items()
        )
    )
    bound = GUARD.max_weight_share * (GUARD.norm_bound + 1) * line["scalars"]["update_norm_median"]
    assert all(bool(torch.isfinite(t).all()) for t in result.final_shared.values())
    assert 0 < distance <= bound, (distance, bound)
    assert line["scalars"].get("guard_cut", 0) >= 1  # capped or clipped, and said so


def test_answers_replayed_from_an_earlier_run_are_refused(
    fleet: Fleet, clean: dict[int, RunResult]
) -> None:
    recorded: list[bytes] = []

    def record(attacker: Attacker, announcement: RoundAnnouncement) -> None:
        frame = update(announcement, shared_like(0.5))
        recorded.append(frame)
        attacker.send("update", frame)

    def replay(attacker: Attacker, announcement: RoundAnnouncement) -> None:
        for frame in recorded:
            attacker.send("update", frame)
        attacker.decline(announcement)

    with Attacker(fleet, record) as attacker:
        attacker.hello(10)
        fleet.serve(ROUNDS, HONEST + 1)  # the attacker's updates count in this run: a member
    with Attacker(fleet, replay) as attacker:
        attacker.hello(10)
        result, lines = fleet.serve(ROUNDS, HONEST + 1)
    assert len(recorded) >= ROUNDS
    assert [line["participants"] for line in lines] == [HONEST] * ROUNDS
    _assert_equal(result, clean[ROUNDS])
    assert fleet.dropped()[EVIL][0] >= ROUNDS


# -- forged operator views -------------------------------------------------------------------


def forge_views(attacker: Attacker, announcement: RoundAnnouncement) -> None:
    """Everything but its own status, retained on its own status topic, for operators to see."""
    honest = [device_name(index) for index in range(HONEST)]
    for topic, frame in forged_views(FLEET, EVIL, honest, announcement.run_id)[:-2]:
        attacker.publish(topic, frame, retain=True)  # the last one kept: sent_at Infinity


def test_forged_operator_views_are_ignored(fleet: Fleet, tmp_path: Path) -> None:
    # Prepare: serve with its dashboard, polled all through the run
    port, token_file = free_port(), tmp_path / "dashboard-token"
    snapshots: list[dict[str, Any]] = []
    running = threading.Event()

    def poll() -> None:
        while running.is_set():
            try:
                request = urllib.request.Request(
                    f"http://127.0.0.1:{port}/api/snapshot",
                    headers={"Authorization": f"Bearer {token_file.read_text().strip()}"},
                )
                with urllib.request.urlopen(request, timeout=10) as response:
                    snapshots.append(strict_json(response.read().decode()))
            except OSError:
                pass  # not listening yet, or already closed
            time.sleep(0.2)

    poller = threading.Thread(target=poll, daemon=True)
    running.set()
    poller.start()
    # Execute: the attacker forges on its own status topic every round
    try:
        with Attacker(fleet, forge_views):
            _, lines = fleet.serve(
                ROUNDS, dashboard=f"127.0.0.1:{port}", dashboard_token_file=token_file
            )
    finally:
        running.clear()
        poller.join(30.0)
    operator = fleet.broker.account("operator")
    view = collect_fleet_view(
        fleet.broker.settings(operator.username, operator.password), FLEET, listen_s=1.0
    )
    # Assert: the run went on; neither view shows anything forged, and both say they ignored
    assert [line["participants"] for line in lines] == [HONEST] * ROUNDS
    honest = {device_name(index) for index in range(HONEST)}
    assert snapshots
    for snapshot in snapshots:
        coordinator = snapshot["coordinator"]
        assert coordinator is None or coordinator["rounds"] == ROUNDS
        rows = {row["device"]: row for row in snapshot["fleet"]}
        assert "ghost" not in rows
        assert all(rows[d]["online"] and not rows[d]["quarantined"] for d in honest & set(rows))
        assert all(d["personalized"] != 0.999 for d in snapshot["devices"])
    assert snapshots[-1]["refused"] > 0
    assert view.coordinator is not None
    assert (view.coordinator.state, view.coordinator.rounds) == ("finished", ROUNDS)
    assert EVIL not in view.devices  # its retained status says sent_at = Infinity
    assert view.refused == 1
    rows = {row["device"]: row for row in view.rows()}
    assert set(rows) <= {*honest, EVIL}
    assert all(rows[d]["online"] and not rows[d]["quarantined"] for d in honest)
    json.dumps(view.as_json(), allow_nan=False)


# == Secure aggregation liars ============================================================

# The attacker runs secure aggregation's real device side (SecureClient) with one twist each: a
# garbage masked vector, shares of another seed than it committed to, or a hello declaring 10^8
# samples. `serve --secagg` must complete every run; honest devices answer every round.


@dataclass
class SecureLiar:
    """The `evil` account in secure rounds: keys, shares and a masked update, with a twist."""

    attacker: Attacker
    samples: int = 10
    delta: dict[str, torch.Tensor] = field(default_factory=lambda: shared_like(0.0))
    masked: Callable[[np.ndarray], np.ndarray] = lambda vector: vector
    after_keys: Callable[[SecureClient], None] = lambda client: None
    announcement: RoundAnnouncement | None = None
    client: SecureClient = field(init=False)

    def __post_init__(self) -> None:
        self.client = SecureClient(EVIL, self._publish)
        self.attacker.on_round = self._on_round
        transport = self.attacker.transport
        assert transport is not None
        transport.subscribe(topics.secure(FLEET), self._on_secure)
        transport.subscribe(topics.secure(FLEET, EVIL), self._on_secure)
        self.attacker.hello(self.samples)

    def _publish(self, message: Message) -> None:
        self.attacker.send("secagg", encode_frame(message))
        if isinstance(message, SecAggKeys):
            self.after_keys(self.client)

    def _on_round(self, _attacker: Attacker, announcement: RoundAnnouncement) -> None:
        if EVIL in announcement.selected:
            self.announcement = announcement
            self.client.join(announcement)

    def _on_secure(self, _topic: str, payload: bytes) -> None:
        message, _ = decode_frame(payload)
        announcement = self.announcement
        if announcement is None or not self.client.receive(message):
            return
        tensors = self.client.mask(announcement, self.delta, self.samples, 0.5, None)
        vector = self.masked(tensors[MASKED_TENSOR].numpy().view(np.uint32).copy())
        frame = update(
            announcement, {MASKED_TENSOR: torch.from_numpy(vector.view(np.int32))}, samples=1
        )
        self.attacker.send("update", frame)


def random_words(vector: np.ndarray) -> np.ndarray:
    """Garbage instead of a masked vector: uniformly random words of the ring."""
    return np.random.default_rng().integers(0, 2**32, vector.size, dtype=np.uint32)


def other_seed(client: SecureClient) -> None:
    """Commit to one self-mask seed, deal shares of another."""
    assert client._round is not None
    client._round.seed = os.urandom(32)


@pytest.fixture(scope="module")
def clean_secure() -> dict[int, RunResult]:
    """The secure runs of the honest devices alone (masks cancel: equal to plain, to 1e-5)."""
    return {
        rounds: run_simulation(
            SimulationSettings.load(
                None, **{**RUN, "secagg": True}, devices=HONEST, rounds=rounds, batched="off"
            )
        )
        for rounds in (1, ROUNDS)
    }


def _secure_serve(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch, rounds: int
) -> tuple[RunResult, list[dict[str, Any]]]:
    monkeypatch.setitem(RUN, "secagg", True)
    return fleet.serve(rounds, min_devices=HONEST + 1)


def test_a_garbage_masked_vector_skips_rounds_and_never_stops_the_run(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Attacker(fleet) as attacker:
        SecureLiar(attacker, masked=random_words)
        result, lines = _secure_serve(fleet, monkeypatch, ROUNDS)
    assert [line["round_id"] for line in lines] == list(range(1, ROUNDS + 1))
    # every honest device answered every round; the sum with the garbage in it was refused once
    assert [line["scalars"]["secagg_survivors"] for line in lines] == [HONEST + 1.0] * ROUNDS
    assert [line["scalars"]["secagg_skipped"] for line in lines] == [1.0] * ROUNDS
    assert [line["scalars"]["secagg_attempts"] for line in lines] == [1.0] * ROUNDS
    initial = load_task("digits").build_model(0).state_dict()
    for name, tensor in initial.items():
        assert torch.equal(result.final_shared[name], tensor), name


def test_a_dealer_of_false_shares_is_quarantined_and_the_honest_sum_applied(
    fleet: Fleet, clean_secure: dict[int, RunResult], monkeypatch: pytest.MonkeyPatch
) -> None:
    with Attacker(fleet) as attacker:
        SecureLiar(attacker, after_keys=other_seed)
        result, lines = _secure_serve(fleet, monkeypatch, ROUNDS)
    assert [line["participants"] for line in lines] == [HONEST] * ROUNDS
    assert [line["scalars"]["secagg_survivors"] for line in lines] == [float(HONEST)] * ROUNDS
    for name, tensor in clean_secure[ROUNDS].final_shared.items():
        assert torch.allclose(result.final_shared[name], tensor, atol=1e-5), name
    dropped, _ = fleet.dropped()[EVIL]
    assert dropped >= ROUNDS  # named each round


def test_a_hello_of_10_to_the_8_samples_weighs_at_most_half_of_a_secure_round(
    fleet: Fleet, clean_secure: dict[int, RunResult], monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = shared_like(1.0)
    norm = 10.0  # --secagg-clip: the most any device's delta may weigh in the sum
    scale = norm / math.sqrt(sum(t.numel() for t in tensors.values()))
    with Attacker(fleet) as attacker:
        SecureLiar(attacker, samples=10**8, delta={k: v * scale for k, v in tensors.items()})
        result, lines = _secure_serve(fleet, monkeypatch, 1)
    (line,) = lines
    assert line["participants"] == HONEST + 1
    reference = clean_secure[1].final_shared
    initial = load_task("digits").build_model(0).state_dict()
    honest_step = _distance(reference, initial)
    distance = _distance(result.final_shared, reference)
    # the water-filling cap gives it the weight of the three others together: half the round
    assert 0 < distance <= 0.5 * (norm + honest_step) + 1e-4, (distance, honest_step)


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in b))


class DroppingAttacker(Attacker):
    """The attacker with a will on its connection, as an agent has: a crash marks it offline."""

    def __enter__(self) -> Attacker:
        will = device_will(FLEET, EVIL)
        self.transport = MqttTransport(attacker_settings(self.fleet), EVIL, will=will)
        self.transport.subscribe(topics.round_announcement(FLEET), self._on_announcement)
        self.transport.subscribe(topics.command(FLEET), self._on_command)
        return self


def test_a_device_lost_after_its_keys_costs_no_phase_its_deadline(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(_client: SecureClient) -> None:
        transport = attacker.transport
        assert transport is not None
        threading.Thread(target=transport.abort).start()  # not from its own network thread

    settled: list[bool] = []  # per short phase: whether it settled before its deadline
    wait = SilentDevices.wait

    def recorded_wait(self: SilentDevices, *args: Any, **kwargs: Any) -> bool:
        settled.append(wait(self, *args, **kwargs))
        return settled[-1]

    monkeypatch.setattr(SilentDevices, "wait", recorded_wait)
    with DroppingAttacker(fleet) as attacker:
        SecureLiar(attacker, after_keys=crash)
        _, lines = _secure_serve(fleet, monkeypatch, 1)
    (line,) = lines
    assert line["participants"] == HONEST
    assert line["scalars"]["secagg_survivors"] == HONEST
    # the broker's will said it was gone: no phase waited out its deadline for it
    assert len(settled) == len(SHORT_PHASES)
    assert all(settled), settled


# -- inbound values: updates that decode to Inf, evaluations out of range ---------------------


def overflowing_int8(attacker: Attacker, announcement: RoundAnnouncement) -> None:
    """An int8 update whose scales (3e38, finite on the wire) decode every level to +-Inf."""
    encoded = compression.encode(shared_like(0.01), INT8)
    encoded[compression.INT8_SCALES] = torch.full_like(encoded[compression.INT8_SCALES], 3e38)
    attacker.send("update", update(announcement, encoded, compression=INT8))
    attacker.decline(announcement)


def test_an_update_decoding_to_inf_under_dp_is_dropped_and_no_round_is_skipped(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(RUN, "compress", "int8")
    monkeypatch.setitem(RUN, "dp_noise", 1.0)
    with Attacker(fleet, overflowing_int8) as attacker:
        attacker.hello(10)
        result, lines = fleet.serve(ROUNDS, min_devices=HONEST + 1)
    assert [line["participants"] for line in lines] == [HONEST] * ROUNDS
    assert all("aggregate_rejected" not in line["scalars"] for line in lines)
    epsilons = [line["scalars"]["dp_epsilon"] for line in lines]
    assert epsilons == sorted(set(epsilons))
    assert result.summary.privacy is not None
    assert result.summary.privacy["rounds_released"] == ROUNDS
    assert all(bool(torch.isfinite(t).all()) for t in result.final_shared.values())
    assert fleet.dropped()[EVIL][0] >= ROUNDS


class EvaluationPoisoner(Attacker):
    """Declines training; answers each evaluation with reports outside the metric's range."""

    def _on_announcement(self, topic: str, payload: bytes) -> None:
        announcement, _ = decode_frame(payload)
        assert isinstance(announcement, RoundAnnouncement)
        if announcement.phase != "evaluate":
            super()._on_announcement(topic, payload)
            return
        report = EvaluationReport(
            run_id=announcement.run_id,
            round_id=announcement.round_id,
            device_id=EVIL,
            metric_name="accuracy",
            personalized=0.5,
            global_model=0.5,
            num_test_samples=10,
            num_train_samples=10,
        )
        raw = json.loads(report.model_dump_json())
        for value in (1e30, 1.5, -1.0):  # within the wire's float bound, outside accuracy's
            raw["personalized"] = raw["global_model"] = value
            self.send("evaluation", raw_update(raw, b""))
        other = report.model_copy(update={"metric_name": "mse", "personalized": 0.0})
        self.send("evaluation", encode_frame(other))  # in range, but not the fleet's metric
        self.decline(announcement)


def test_evaluations_outside_the_metric_range_are_dropped_and_change_no_metric(
    fleet: Fleet, clean: dict[int, RunResult]
) -> None:
    with EvaluationPoisoner(fleet, Attacker.decline) as attacker:
        attacker.hello(10)
        result, lines = fleet.serve(ROUNDS, min_devices=HONEST + 1)
    assert [line["participants"] for line in lines] == [HONEST] * ROUNDS
    _assert_equal(result, clean[ROUNDS])
    assert sorted(r.device_id for r in result.reports) == [device_name(i) for i in range(HONEST)]
    assert result.summary.metrics == clean[ROUNDS].summary.metrics
    assert result.summary.rejected_messages >= 4  # after the last fleet status: not in it
