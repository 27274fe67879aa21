"""DP-FTRL's tree aggregation against closed forms, brute force and an independent accountant."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import norm

from coordinator.run.settings import SimulationSettings
from coordinator.stages.accountant import DpRound
from coordinator.stages.ftrl import (
    ParticipationLimit,
    TreeNoise,
    effective_multiplier,
    prefix_nodes,
    run_sensitivity,
    tree_sensitivity,
)
from coordinator.stages.tree_accountant import TreeAccountant, tree_noise_for_epsilon

SHAPES = {"b": torch.zeros(3), "w": torch.zeros(2, 2)}


@pytest.mark.parametrize("t", range(1, 130))
def test_a_prefix_is_one_node_per_set_bit_covering_exactly_its_rounds(t: int) -> None:
    nodes = prefix_nodes(t)
    covered = [leaf for level, index in nodes for leaf in range(index << level, index + 1 << level)]
    assert covered == list(range(t))
    assert len(nodes) == bin(t).count("1") <= math.floor(math.log2(t)) + 1


def test_without_noise_the_released_rounds_add_up_to_the_true_prefix_sums() -> None:
    tree = TreeNoise(seed=5)
    leaves = [torch.full((3,), float(t)) for t in range(1, 12)]
    released = torch.zeros(3, dtype=torch.float64)
    for t, leaf in enumerate(leaves, start=1):
        released += leaf + tree.increment({"b": leaf}, std=0.0)["b"]
        assert torch.equal(released, sum(leaves[:t], torch.zeros(3, dtype=torch.float64)))


def test_the_released_noise_of_a_prefix_is_the_sum_of_its_nodes() -> None:
    tree, fresh = TreeNoise(seed=9, restart=8), TreeNoise(seed=9, restart=8)
    carried = {n: torch.zeros(t.shape, dtype=torch.float64) for n, t in SHAPES.items()}
    for t in range(1, 20):
        for name, value in tree.increment(SHAPES, std=2.0).items():
            carried[name] += value
        completed_trees = (t - 1) // 8
        expected = {n: torch.zeros_like(v) for n, v in carried.items()}
        for done in range(completed_trees):  # a completed tree leaves its root's noise
            for name, value in fresh._node(done, 3, 0, SHAPES).items():
                expected[name] += 2.0 * value
        for name, value in fresh.prefix_noise(t, SHAPES).items():
            expected[name] += 2.0 * value
        for name in carried:
            assert torch.allclose(carried[name], expected[name], atol=1e-12)


@pytest.mark.parametrize("t", [1, 3, 7, 8, 13])
def test_a_prefix_noise_variance_is_its_node_count_times_sigma_squared(t: int) -> None:
    tree = TreeNoise(seed=2)
    big = {"w": torch.zeros(40_000)}
    total = torch.zeros(40_000, dtype=torch.float64)
    for _ in range(t):
        total += tree.increment(big, std=1.5)["w"]
    expected = len(prefix_nodes(t)) * 1.5**2
    assert float(total.var()) == pytest.approx(expected, rel=0.04)  # 40k samples: ~0.7% s.e.


def test_a_resumed_tree_keeps_the_released_nodes_and_draws_the_later_ones_anew() -> None:
    """The model's noise goes on from where it was; no node a lost round used is used again."""
    straight, stopped = TreeNoise(seed=11), TreeNoise(seed=11)
    first = [straight.increment(SHAPES, 1.0) for _ in range(8)]
    carried = {n: torch.zeros(t.shape, dtype=torch.float64) for n, t in SHAPES.items()}
    for _ in range(6):
        for name, value in stopped.increment(SHAPES, 1.0).items():
            carried[name] += value
    resumed = TreeNoise.resume(stopped.state_dict())
    assert resumed.rounds == 6
    for t in (7, 8):
        step = resumed.increment(SHAPES, 1.0)
        carried = {n: carried[n] + step[n] for n in carried}
        assert not torch.equal(step["w"], first[t - 1]["w"])  # later nodes drawn anew
        for name, value in resumed.prefix_noise(t, SHAPES).items():
            torch.testing.assert_close(carried[name], value)
    for t in (4, 6):  # nodes complete by the checkpoint keep their noise
        for name, value in straight.prefix_noise(t, SHAPES).items():
            assert torch.equal(resumed.prefix_noise(t, SHAPES)[name], value)
    assert not torch.equal(
        resumed.prefix_noise(8, SHAPES)["w"], straight.prefix_noise(8, SHAPES)["w"]
    )
    with pytest.raises(ValueError, match="not a tree's state"):
        TreeNoise.resume({"seed": None, "rounds": 1})


def _brute_sensitivity(leaves: int, participations: int) -> int:
    """The worst, over every set of at most k rounds, of sum over nodes |rounds in node|^2."""
    nodes = [
        set(range(index << level, index + 1 << level))
        for level in range(leaves.bit_length())
        for index in range(leaves >> level)
    ]
    best = 0
    for size in range(1, participations + 1):
        for rounds in itertools.combinations(range(leaves), size):
            best = max(best, sum(len(node.intersection(rounds)) ** 2 for node in nodes))
    return best


@pytest.mark.parametrize(("leaves", "k"), [(t, k) for t in range(1, 11) for k in (1, 2, 3, 4)])
def test_the_sensitivity_is_the_worst_participation_pattern(leaves: int, k: int) -> None:
    assert tree_sensitivity(leaves, k) == _brute_sensitivity(leaves, min(k, leaves))


def test_the_sensitivity_closed_forms() -> None:
    for t in range(1, 300):  # one round per tree: ceil(log2(T + 1)) nodes
        assert tree_sensitivity(t, 1) == math.ceil(math.log2(t + 1))
    for level in range(8):  # every round of a tree of T = 2^L leaves: T (2T - 1)
        t = 1 << level
        assert tree_sensitivity(t) == t * (2 * t - 1)
    assert run_sensitivity(20, 8, 1) == 2 * 4 + 3  # two full trees of 8, one of 4
    assert effective_multiplier(3.0, 20, 8, 1) == pytest.approx(3.0 / math.sqrt(11))


def _exact_gaussian_epsilon(multiplier: float, delta: float) -> float:
    """Balle and Wang 2018 (Theorem 8): the Gaussian's exact (epsilon, delta) curve."""

    def excess(eps: float) -> float:
        a, b = 1 / (2 * multiplier), eps * multiplier
        return float(norm.cdf(a - b) - math.exp(eps) * norm.cdf(-a - b) - delta)

    root: float = brentq(excess, 0.0, 500.0)
    return root


@pytest.mark.parametrize(
    ("z", "rounds", "restart", "k"),
    [(1.0, 16, None, 1), (2.0, 100, 32, 2), (5.0, 64, None, None), (0.8, 50, 16, 1)],
)
def test_the_accountant_matches_the_exact_gaussian(
    z: float, rounds: int, restart: int | None, k: int | None
) -> None:
    accountant = TreeAccountant(1e-5, restart, k)
    for _ in range(rounds):
        spent = accountant.record(DpRound(z, 10, 10.0))
    spread = sum(  # every tree's sensitivity by brute force where it is small, else closed form
        _brute_sensitivity(n, min(k, n)) if k is not None and n <= 10 else tree_sensitivity(n, k)
        for n in _tree_sizes(rounds, restart)
    )
    exact = _exact_gaussian_epsilon(z / math.sqrt(spread), 1e-5)
    assert spent.pld is not None
    assert spent.pld == pytest.approx(exact, rel=5e-3)
    assert spent.pld >= exact * (1 - 1e-4)  # the PLD rounds pessimistically
    assert spent.rdp >= exact  # RDP is an upper bound
    assert accountant.epsilon() == min(spent.rdp, spent.pld)


def _tree_sizes(rounds: int, restart: int | None) -> list[int]:
    if restart is None:
        return [rounds]
    return [restart] * (rounds // restart) + ([rounds % restart] if rounds % restart else [])


def test_the_accountant_refuses_rounds_of_another_multiplier() -> None:
    accountant = TreeAccountant(1e-5, None, None)
    accountant.record(DpRound(1.0, 5, 5.0))
    with pytest.raises(ValueError, match="one noise multiplier"):
        accountant.record(DpRound(2.0, 5, 5.0))
    assert len(accountant.rounds) == 1


def test_the_participation_limit_is_per_tree() -> None:
    limit = ParticipationLimit(2, restart=4)
    for round_number in (1, 2):
        assert limit.allowed(round_number, ["a", "b"]) == {"a", "b"}
        limit.count(round_number, ["a"])
    assert limit.allowed(3, ["a", "b"]) == {"b"}
    assert limit.allowed(5, ["a", "b"]) == {"a", "b"}  # a new tree


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"dp_sampling": "poisson"}, "draws no secret sample"),
        ({"dp_placement": "device", "secagg": True}, "added by the coordinator"),
        ({"dp_adaptive_clip": True}, "adaptive-clip is not supported"),
    ],
)
def test_ftrl_tree_refuses_what_it_would_ignore(options: dict[str, object], reason: str) -> None:
    settings = SimulationSettings.load(
        None, task="digits", dp_noise=1.0, dp_mechanism="ftrl-tree", **options
    )
    with pytest.raises(ValueError, match=reason):
        settings.privacy()


def test_tree_options_need_the_tree_and_the_tree_takes_the_cohort_as_selected() -> None:
    plain = SimulationSettings.load(
        None, task="digits", dp_noise=1.0, dp_options={"tree_restart": 8}
    )
    with pytest.raises(ValueError, match="need --dp-mechanism ftrl-tree"):
        plain.privacy()
    fedavg = SimulationSettings.load(None, task="digits", dp_noise=1.0).privacy()
    assert fedavg is not None
    assert fedavg.sampling == "poisson"
    tree = SimulationSettings.load(None, task="digits", dp_noise=1.0, dp_mechanism="ftrl-tree")
    assert (tree.privacy() or fedavg).sampling == "fixed"


def test_the_planned_tree_noise_spends_the_target_and_no_less_noise_would() -> None:
    z = tree_noise_for_epsilon(4.0, 1e-5, 30, 10, 1)
    accountant = TreeAccountant(1e-5, 10, 1)
    for _ in range(30):
        spent = accountant.record(DpRound(z, 100, 10.0))
    assert spent.tighter <= 4.0
    less = TreeAccountant(1e-5, 10, 1)
    for _ in range(30):
        tighter = less.record(DpRound(z * 0.99, 100, 10.0))
    assert tighter.tighter > 4.0


def test_a_tensors_node_noise_does_not_depend_on_the_other_tensors_shared() -> None:
    """A stage that shares fewer tensors (pretraining, then FedAlt) keeps each node's draw."""
    both, one = TreeNoise(seed=4), TreeNoise(seed=4)
    wide = {"a": torch.zeros(3), "b": torch.zeros(2), "n": torch.zeros(1, dtype=torch.long)}
    for t in (1, 2, 3):
        drawn = both.prefix_noise(t, wide)
        assert torch.equal(drawn["a"], one.prefix_noise(t, {"a": torch.zeros(3)})["a"])
        assert torch.equal(drawn["n"], torch.zeros(1, dtype=torch.float64))  # counters: none
