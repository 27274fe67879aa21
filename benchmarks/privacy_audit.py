"""Empirical privacy audit: canary devices in a federated run, an epsilon lower bound from one run.

A client-level one-run audit (Steinke, Nasr and Jagielski 2023; the canaries of Andrew et al.
2024): m canary devices, each flips a fair coin. Under add/remove-one relations (Poisson
sampling) a canary that drew "in" joins the fleet and one that drew "out" stays away; under
replace-one (fixed-size sampling) every canary is in the fleet, sending +norm * u_i if "in" and
-norm * u_i if "out", the two neighbours a replacement may choose between. u_i is a random unit
direction; the norm is far above the clip, so the mechanism's own clipping gives every canary
the largest contribution it allows. Beside the canaries, ordinary devices send random updates.
The auditor sees only what the mechanism releases each round, scores canary i by the inner
product of u_i with each release, summed (`scores`), guesses "in" for the highest scores and
"out" for the lowest, and turns its correct guesses into an epsilon lower bound at 95%
(`benchmarks.audit_bounds`).

A mechanism is a callable, `Mechanism`: given the canaries and a generator it runs its rounds and
returns what each round released (in update units) and the epsilon it reports. `EngineRun` is a
run as the coordinator does it: the coordinator's `PrivacyEngine` plans each round (Poisson or
fixed-size cohort, the noise, adaptive clipping), each sampled device applies
`device_agent.privacy.privatize` (clip, its noise share, its within-clip bit), and the engine
privatizes and accounts what arrives: each update (coordinator placement), or their sum
(device placement, which runs only under secure aggregation: the masks cancel in the sum, and
the audit takes the sum exactly, without the protocol's fixed-point rounding).

DP-FTRL's tree (`mechanism="ftrl-tree"`) is an `EngineRun` too: it is accounted for removing
a device's contributions, so an "out" canary takes part and sends nothing; each round releases
the difference of consecutive noisy prefix sums. Its cohorts are not secret (no amplification
is claimed), so the auditor knows which rounds a canary was in, and knows the tree: it weighs
the model after each round by the inverse of the tree noise's covariance (`tree_covariance`),
the Gaussian likelihood ratio's statistic, rather than taking the last prefix alone. The
distributed discrete Gaussian runs each device's ring encoding (`noised_ring_values`: the grid
of the coordinator's secure round, conditional rounding, N_Z noise); the audit sums the
integers exactly (the masks cancel) and decodes by the same scale. A mechanism outside the
engine is any callable returning its per-round releases and its epsilon.

    python -m benchmarks.privacy_audit
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

import numpy as np
import torch

from benchmarks.audit_bounds import audit_lower_bound, one_shot_estimate
from benchmarks.common import markdown_table, write_section
from coordinator.engine.selection import select_devices
from coordinator.stages.accountant import DpRound, epsilon_of
from coordinator.stages.ftrl import TreeNoise, prefix_nodes
from coordinator.stages.privacy import PrivacyEngine
from coordinator.stages.secure.bounds import plan_round
from coordinator.strategies.base import DeviceInfo, FleetSnapshot, ReceivedUpdate
from device_agent.algorithms.base import LocalResult
from device_agent.privacy import privatize
from protocols.discrete_gaussian import noised_ring_values
from protocols.messages import DevicePrivacy
from protocols.privacy import PrivacySettings, noise_generator
from protocols.secure_aggregation import SecureAggregationSettings, delta_scale

REPO: Final = Path(__file__).resolve().parents[1]
MARKER: Final = "<!-- privacy-audit -->"
DELTA: Final = 1e-5
CONFIDENCE: Final = 0.95


@dataclass(frozen=True)
class Canaries:
    """The audit's canaries: unit directions (one row each) and the coin each drew."""

    directions: np.ndarray
    included: np.ndarray
    norm: float
    """The L2 norm each canary's update is sent at, before the mechanism clips it."""


@dataclass(frozen=True)
class Release:
    """What a mechanism released: one aggregate per round (rounds x dimension), its epsilon."""

    aggregates: np.ndarray
    epsilon: float
    taken_part: np.ndarray | None = None
    """Which canaries (columns) each round (rows) was announced to take, when the mechanism
    publishes its cohorts (DP-FTRL: no secret sampling); None when they are secret."""
    covariance: np.ndarray | None = None
    """Rounds x rounds: how the noise of the model after each round is correlated (DP-FTRL's
    tree: the nodes two prefixes share), when it is not fresh each round."""


Mechanism = Callable[[Canaries, np.random.Generator], Release]


def draw_canaries(count: int, dimension: int, norm: float, rng: np.random.Generator) -> Canaries:
    """`count` random unit directions in `dimension`, each canary in with probability 1/2."""
    directions = rng.standard_normal((count, dimension))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    return Canaries(directions, rng.random(count) < 0.5, norm)


def canary_id(index: int) -> str:
    """A canary device's id."""
    return f"canary-{index:05d}"


OutCanary = Literal["absent", "opposite", "zero"]
"""What a canary that drew "out" does: stays out of the fleet (add/remove one device), takes
part sending -norm * u_i (replace one), or takes part sending nothing (zero out)."""


@dataclass(frozen=True)
class EngineRun:
    """A run through the project's privacy code: the engine's rounds, the devices' privatize."""

    settings: PrivacySettings
    participation: float
    rounds: int
    others: int = 100
    """Ordinary devices, each sending a random update of norm between C/2 and 2C each round."""
    out: OutCanary | None = None
    """The neighbour relation audited; by default the one the run is accounted under
    (Poisson: absent; fixed size: opposite; DP-FTRL's tree: zero)."""

    @property
    def out_canary(self) -> OutCanary:
        """What an "out" canary does in this run."""
        if self.out is not None:
            return self.out
        if self.settings.mechanism == "ftrl-tree":
            return "zero"
        return "absent" if self.settings.sampling == "poisson" else "opposite"

    def __call__(self, canaries: Canaries, rng: np.random.Generator) -> Release:
        """Run the rounds; the aggregate each released (what the strategy averages)."""
        engine = PrivacyEngine(self.settings, self.participation, int(rng.integers(2**62)))
        device_noise = noise_generator(int(rng.integers(2**62)))
        updates = self._updates(canaries)
        ordinary = [f"device-{j:05d}" for j in range(self.others)]
        fleet = FleetSnapshot(tuple(DeviceInfo(d, 1, True) for d in sorted([*updates, *ordinary])))
        dimension = canaries.directions.shape[1]
        shared = {"w": torch.zeros(dimension, dtype=torch.float64)}
        aggregates = np.zeros((self.rounds, dimension))
        canary_index = {canary_id(i): i for i in range(len(canaries.included))}
        taken_part = np.zeros((self.rounds, len(canaries.included)), dtype=bool)
        for round_index in range(self.rounds):
            selected = self._select(engine, fleet, rng)
            planned = engine.plan(fleet, selected)
            taken_part[round_index, [canary_index[d] for d in selected if d in canary_index]] = True
            scale = self._ring(engine, selected, planned, dimension)
            sent = [
                self._device(
                    d,
                    updates[d] if d in updates else self._ordinary(rng, dimension),
                    planned,
                    device_noise,
                )
                for d in selected
            ]
            received, within = self._received(sent, planned, scale, rng)
            released = engine.privatize(
                received, shared, presummed=self.settings.placement == "device" and bool(sent)
            )
            weight = sum(u.num_samples for u in released)
            mean = sum(u.shared_delta["w"].double() * u.num_samples for u in released) / weight
            aggregates[round_index] = np.asarray(mean)
            engine.finish(within, reporters=len(sent))
        public = None if engine.mechanism.secret_sampling else taken_part
        noise = engine.mechanism.noise
        tree = tree_covariance(noise, self.rounds) if isinstance(noise, TreeNoise) else None
        return Release(aggregates, engine.epsilon, public, tree)

    def _updates(self, canaries: Canaries) -> dict[str, np.ndarray]:
        """The canaries in the fleet and the update each sends every round it is sampled."""
        present = {}
        for index, (direction, inside) in enumerate(
            zip(canaries.directions, canaries.included, strict=True)
        ):
            sign = {"absent": 0.0, "opposite": -1.0, "zero": 0.0}[self.out_canary]
            if inside or self.out_canary != "absent":
                present[canary_id(index)] = (1.0 if inside else sign) * canaries.norm * direction
        return present

    def _ordinary(self, rng: np.random.Generator, dimension: int) -> np.ndarray:
        direction = rng.standard_normal(dimension)
        length = rng.uniform(0.5, 2.0) * self.settings.clip_norm
        return np.asarray(direction * length / np.linalg.norm(direction))

    def _select(
        self, engine: PrivacyEngine, fleet: FleetSnapshot, rng: np.random.Generator
    ) -> list[str]:
        """The round's cohort: the engine's Poisson draw, or the strategies' fixed-size sample.

        Either is drawn from the devices the engine leaves online (as `rounds.py` plans on).
        """
        candidates = engine.cohort(fleet, rng).online()
        if self.settings.sampling == "poisson":
            return candidates
        return list(select_devices(candidates, self.participation, rng))

    @staticmethod
    def _ring(
        engine: PrivacyEngine, selected: Sequence[str], planned: DevicePrivacy, dimension: int
    ) -> float | None:
        """The discrete Gaussian's grid: the coordinator's secure round, told to the engine."""
        if not planned.discrete:
            return None
        secure = plan_round(SecureAggregationSettings(), selected, planned, 1, len(selected))
        engine.ring(secure, dimension)
        return delta_scale(secure)

    @staticmethod
    def _device(
        device: str, update: np.ndarray, planned: DevicePrivacy, noise: torch.Generator
    ) -> tuple[str, LocalResult, float | None]:
        """What the device sends: its privatized result and within-clip bit."""
        result = LocalResult({"w": torch.from_numpy(update)}, 1, 0.0, {})
        private, bit = privatize(result, planned, noise)
        return device, private, bit

    def _received(
        self,
        sent: Sequence[tuple[str, LocalResult, float | None]],
        planned: DevicePrivacy,
        scale: float | None,
        rng: np.random.Generator,
    ) -> tuple[list[ReceivedUpdate], list[float | None]]:
        """What reaches the engine: each update, or (device placement) their secure sum.

        Under the discrete Gaussian each device sends its ring integers (scaled, rounded, noised
        as `SecureClient.mask` does); their exact sum is decoded by the coordinator's scale.
        """
        if self.settings.placement == "coordinator" or not sent:
            updates = [ReceivedUpdate(d, 1, 0.0, r.shared_delta, within_clip=b) for d, r, b in sent]
            return updates, [u.within_clip for u in updates]
        deltas = [r.shared_delta["w"] for _, r, _ in sent]
        if scale is not None:
            rings = [
                noised_ring_values(d.numpy(), planned.clip_norm, scale, planned.noise_std, rng)
                for d in deltas
            ]
            deltas = [torch.from_numpy(np.sum(rings, axis=0) / scale)]
        total = torch.stack(deltas).sum(dim=0)
        bits = [b for _, _, b in sent if b is not None]
        within = math.fsum(bits) if self.settings.adaptive_clipping else None
        return [ReceivedUpdate("secure-sum", len(sent), 0.0, {"w": total})], [within]


@dataclass(frozen=True)
class AuditResult:
    """One audit: the epsilon reported, the empirical lower bound, the one-shot estimate."""

    reported: float
    lower_bound: float
    guesses: int
    correct: int
    estimate: float


def tree_covariance(noise: TreeNoise, rounds: int) -> np.ndarray:
    """The nodes the model's noise after rounds s and t share (their covariance / sigma^2).

    After round t the model holds each completed tree's last prefix and the current tree's
    prefix of t (`TreeNoise.increment` summed); every node is an independent N(0, sigma^2).
    """

    def nodes(t: int) -> set[tuple[int, int, int]]:
        tree, leaves = noise.position(t)
        done = prefix_nodes(noise.restart) if noise.restart is not None else []
        return {(k, *n) for k in range(tree) for n in done} | {
            (tree, *n) for n in prefix_nodes(leaves)
        }

    held = [nodes(t) for t in range(1, rounds + 1)]
    return np.array([[len(a & b) for b in held] for a in held], dtype=np.float64)


def scores(release: Release, canaries: Canaries) -> np.ndarray:
    """Each canary's score: the inner product of its direction with each release, summed.

    Over every round, or, where the cohorts are published, over the rounds it took part in.
    Under correlated noise (`Release.covariance`) the score is the Gaussian likelihood ratio's
    statistic instead: the canary's projected model after each round, weighted by K^-1 m, m its
    contribution to the model after each round and K the noise's covariance.
    """
    each = canaries.directions @ release.aggregates.T  # canaries x rounds
    taken = np.ones(each.shape, dtype=bool) if release.taken_part is None else release.taken_part.T
    if release.covariance is None:
        return np.asarray((each * taken).sum(axis=1))
    weights = np.linalg.solve(release.covariance, np.cumsum(taken, axis=1).T).T
    return np.asarray((weights * np.cumsum(each, axis=1)).sum(axis=1))


def audit(
    mechanism: Mechanism, *, canaries: int, dimension: int, seed: int, norm: float = 10.0
) -> AuditResult:
    """Run `mechanism` once with `canaries` canaries; its epsilon beside the audit's figures."""
    rng = np.random.default_rng(seed)
    drawn = draw_canaries(canaries, dimension, norm, rng)
    release = mechanism(drawn, rng)
    scored = scores(release, drawn)
    bound, guessed, correct = audit_lower_bound(scored, drawn.included, DELTA, beta=1 - CONFIDENCE)
    estimate = one_shot_estimate(scored, drawn.included, DELTA)
    return AuditResult(release.epsilon, bound, guessed, correct, estimate)


@dataclass(frozen=True)
class Misreported:
    """A check on the audit itself: `run`'s noise, but the epsilon of `claimed` reported.

    An accountant that under-reports by this much must fail the audit. Poisson runs only (the
    claimed epsilon takes the sampling rate alone).
    """

    run: EngineRun
    claimed: float

    def __call__(self, canaries: Canaries, rng: np.random.Generator) -> Release:
        """The run's releases, with the epsilon of the claimed noise multiplier."""
        released = self.run(canaries, rng)
        population = 1_000_000
        spent = DpRound(self.claimed, population, self.run.participation * population)
        epsilon = epsilon_of([spent] * self.run.rounds, "poisson", self.run.settings.delta)
        return Release(released.aggregates, epsilon)


@dataclass(frozen=True)
class Config:
    """One row of the table: the mechanism in words and the run (misreported, for the check)."""

    label: str
    run: EngineRun
    claimed: float | None = None

    @property
    def mechanism(self) -> Mechanism:
        """The callable audited: the run, or the run with its epsilon misreported."""
        return self.run if self.claimed is None else Misreported(self.run, self.claimed)

    def describe(self) -> list[str]:
        """The mechanism, z, rounds and sampling, as table cells."""
        settings, run = self.run.settings, self.run
        drawn = (
            f"Poisson q={run.participation:g}"
            if settings.sampling == "poisson"
            else f"fixed, {run.participation:.0%} of the fleet"
        )
        if settings.tree_participations is not None:
            drawn += f", at most {settings.tree_participations} rounds a device"
        z = f"{settings.noise_multiplier:g}"
        if self.claimed is not None:
            z += f" (reports z={self.claimed:g})"
        return [self.label, z, str(run.rounds), drawn]


def dp(z: float, **options: object) -> PrivacySettings:
    """DP settings at noise multiplier `z`, delta 1e-5, clip 1, the rest as given."""
    return PrivacySettings.model_validate({"noise_multiplier": z, "delta": DELTA, **options})


COORDINATOR: Final = "DP-FedAvg, coordinator noise"
FTRL: Final = "DP-FTRL, tree aggregation"
DISCRETE: Final = "DP-FedAvg, distributed discrete Gaussian (secure sum)"
TREE: Final = {"mechanism": "ftrl-tree", "sampling": "fixed"}
CONFIGS: Final = (
    Config(COORDINATOR, EngineRun(dp(2.5), 0.5, 10)),
    Config(COORDINATOR, EngineRun(dp(3.0), 1.0, 5)),
    Config(COORDINATOR, EngineRun(dp(1.0), 0.1, 20)),
    Config(COORDINATOR, EngineRun(dp(5.0, sampling="fixed"), 0.5, 5)),
    Config(COORDINATOR, EngineRun(dp(6.0, sampling="fixed"), 1.0, 5)),
    Config("DP-FedAvg, device noise (secure sum)", EngineRun(dp(2.5, placement="device"), 0.5, 10)),
    Config("DP-FedAvg, adaptive clipping", EngineRun(dp(2.5, adaptive_clipping=True), 0.5, 10)),
    Config(FTRL, EngineRun(dp(14.0, **TREE), 1.0, 10)),
    Config(FTRL, EngineRun(dp(5.0, **TREE, tree_participations=2), 0.2, 10)),
    Config(
        DISCRETE, EngineRun(dp(3.5, placement="device", distribution="discrete-gaussian"), 0.5, 10)
    ),
    Config("sanity: tiny noise", EngineRun(dp(0.2), 0.5, 10)),
    Config(
        "sanity: tiny noise, DP-FTRL", EngineRun(dp(0.2, **TREE, tree_participations=2), 0.2, 10)
    ),
    Config("sanity: no noise", EngineRun(dp(0.0), 0.5, 10)),
    Config("check: under-reported", EngineRun(dp(0.5), 0.5, 10), claimed=8.0),
)
CANARIES: Final = 1000
DIMENSION: Final = 5000


def _cell(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.2f}"


def main() -> None:
    """Audit every configuration once and write the table."""
    rows = []
    for index, config in enumerate(CONFIGS):
        result = audit(config.mechanism, canaries=CANARIES, dimension=DIMENSION, seed=index)
        rows.append([
            *config.describe(), _cell(result.reported),
            f"**{_cell(result.lower_bound)}** ({result.correct}/{result.guesses})",
            _cell(result.estimate),
        ])  # fmt: skip
        print(rows[-1], flush=True)
    header = ["mechanism", "z", "rounds", "sampling", "reported epsilon",
              "lower bound (95%, correct/guesses)", "one-shot estimate"]  # fmt: skip
    lines = [
        MARKER,
        *markdown_table(header, rows),
        "",
        f"{CANARIES} canaries, dimension {DIMENSION}, 100 ordinary devices, delta {DELTA:g}; "
        "`python -m benchmarks.privacy_audit`.",
        MARKER,
    ]
    write_section(REPO / "docs/benchmarks.md", "\n".join(lines), MARKER)


if __name__ == "__main__":
    main()
