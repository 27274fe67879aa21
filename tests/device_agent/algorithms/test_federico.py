"""FedeRiCo's device half against hand-computed values and sampling statistics."""

from __future__ import annotations

import math
from itertools import combinations

import numpy as np
import pytest
import torch
from torch import nn

from device_agent.algorithms.federico import Collaborators, sample_peers
from export.mixture import MixtureModel
from protocols.algorithms import FedericoConfig, PeerSampling

OWNERS = ["me", "a", "b", "c", "d"]


def _memory(owners: list[str] = OWNERS) -> Collaborators:
    return Collaborators.from_state({}, owners)


def test_weights_are_a_softmax_of_the_ema_of_losses() -> None:
    # Prepare: two E-steps refreshing different owners (beta = 0.6 on the newest loss)
    config = FedericoConfig(beta=0.6, tau=2.0)
    memory = _memory()
    # Execute
    memory.observe({"me": 1.0, "a": 3.0}, config)
    memory.observe({"me": 2.0, "b": 0.5}, config)
    # Assert: stale entries keep their last loss and still move toward it (Alg. 1 l.10-14)
    last = np.array([2.0, 3.0, 0.5, 0.0, 0.0])
    first_average = 0.6 * np.array([1.0, 3.0, 0.0, 0.0, 0.0])
    average = 0.4 * first_average + 0.6 * last
    np.testing.assert_allclose(memory.average_loss, average)
    expected = np.exp(-average / 2.0) / np.exp(-average / 2.0).sum()
    np.testing.assert_allclose(memory.weights(config), expected)
    assert memory.seen.tolist() == [True, True, True, False, False]


def test_weights_stay_finite_for_huge_summed_losses() -> None:
    config = FedericoConfig(beta=1.0)
    memory = _memory(["me", "a"])
    memory.observe({"me": 1e6, "a": 1e6 + 2.0}, config)
    weights = memory.weights(config)
    assert np.isfinite(weights).all()
    np.testing.assert_allclose(weights, [1 / (1 + math.exp(-2.0)), 1 / (1 + math.exp(2.0))])


def test_masking_hides_unseen_models_and_m_zero_forces_it() -> None:
    memory = _memory()
    memory.observe({"me": 5.0}, FedericoConfig(beta=1.0))
    optimistic = memory.weights(FedericoConfig(beta=1.0))
    assert optimistic[0] < optimistic[1]  # unseen models look perfect: explored first
    for config in (FedericoConfig(unseen_policy="mask"), FedericoConfig(neighbours=0)):
        assert memory.weights(config).tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_cumulative_tracking_sums_only_fresh_losses() -> None:
    config = FedericoConfig(loss_tracking="cumulative")
    memory = _memory(["me", "a"])
    memory.observe({"me": 1.0, "a": 2.0}, config)
    memory.observe({"me": 1.5}, config)
    np.testing.assert_allclose(memory.average_loss, [2.5, 2.0])


def test_mean_losses_at_tau_one_over_n_weigh_like_summed_losses_at_tau_one() -> None:
    n = 40
    summed, averaged = _memory(["me", "a", "b"]), _memory(["me", "a", "b"])
    losses = {"me": 12.0, "a": 9.0, "b": 30.0}
    summed.observe(losses, FedericoConfig())
    averaged.observe({k: v / n for k, v in losses.items()}, FedericoConfig())
    np.testing.assert_allclose(
        summed.weights(FedericoConfig()), averaged.weights(FedericoConfig(tau=1 / n))
    )


def test_state_round_trips_and_new_owners_start_unseen() -> None:
    memory = _memory(["me", "a"])
    memory.observe({"me": 1.0, "a": 2.0}, FedericoConfig())
    restored = Collaborators.from_state(memory.as_state(), ["me", "a", "z"])
    assert restored.owners == ["me", "a", "z"]
    np.testing.assert_allclose(restored.average_loss[:2], memory.average_loss)
    assert restored.seen.tolist() == [True, True, False]
    assert restored.average_loss[2] == 0.0


def test_members_are_seen_heavy_enough_and_capped_by_top_k() -> None:
    memory = _memory()
    memory.observe({"me": 1.0, "a": 1.5, "b": 2.0, "c": 40.0}, FedericoConfig(beta=1.0))
    config = FedericoConfig(beta=1.0, unseen_policy="mask", min_weight=1e-3)
    assert memory.members(config) == ["me", "a", "b"]  # c is negligible, d never evaluated
    assert memory.members(config.model_copy(update={"top_k": 2})) == ["me", "a"]


def test_greedy_sampling_takes_the_top_m_peers_never_self() -> None:
    config = FedericoConfig(neighbours=2, epsilon=0.0)
    weights = np.array([0.9, 0.01, 0.05, 0.03, 0.01])
    rng = np.random.default_rng(0)
    for _ in range(50):
        assert sample_peers(OWNERS, weights, "me", config, rng) == ["b", "c"]


def test_uniform_sampling_draws_distinct_peers_with_equal_frequencies() -> None:
    config = FedericoConfig(neighbours=2, epsilon=1.0)
    weights = np.array([0.9, 0.01, 0.05, 0.03, 0.01])
    rng = np.random.default_rng(1)
    draws = 8000
    counts = dict.fromkeys(OWNERS[1:], 0)
    for _ in range(draws):
        peers = sample_peers(OWNERS, weights, "me", config, rng)
        assert len(set(peers)) == 2
        assert "me" not in peers
        for peer in peers:
            counts[peer] += 1
    expected = draws * 2 / 4
    chi_square = sum((count - expected) ** 2 / expected for count in counts.values())
    assert chi_square < 16.3  # 3 degrees of freedom, p = 0.001


@pytest.mark.parametrize("sampling", ["per_round", "per_slot"])
def test_exploration_frequency_matches_epsilon(sampling: PeerSampling) -> None:
    # Prepare: a clear top-2 {b, c}; a uniform draw of 2 of the 4 peers is {b, c} w.p. 1/6
    epsilon, draws = 0.3, 20000
    config = FedericoConfig(neighbours=2, epsilon=epsilon, sampling=sampling)
    weights = np.array([0.5, 0.05, 0.25, 0.15, 0.05])
    rng = np.random.default_rng(2)
    # Execute
    off_greedy = sum(
        set(sample_peers(OWNERS, weights, "me", config, rng)) != {"b", "c"} for _ in range(draws)
    )
    # Assert: the share of non-greedy samples is what epsilon implies, within 4 sigma
    if sampling == "per_round":
        probability = epsilon * (1 - 1 / len(list(combinations(range(4), 2))))
    else:  # slot 1 explores w.p. eps (3/4 of it off b), then slot 2 likewise over the rest
        slot1_b = (1 - epsilon) + epsilon / 4
        slot2_c_given_b = (1 - epsilon) + epsilon / 3
        slot1_c = epsilon / 4
        slot2_b_given_c = (1 - epsilon) * 1 + epsilon / 3
        probability = 1 - (slot1_b * slot2_c_given_b + slot1_c * slot2_b_given_c)
    sigma = math.sqrt(probability * (1 - probability) / draws)
    assert abs(off_greedy / draws - probability) < 4 * sigma


def test_no_peers_to_sample_with_m_zero_or_alone() -> None:
    rng = np.random.default_rng(0)
    weights = np.ones(5) / 5
    assert sample_peers(OWNERS, weights, "me", FedericoConfig(neighbours=0), rng) == []
    alone = sample_peers(["me"], np.ones(1), "me", FedericoConfig(neighbours=3), rng)
    assert alone == []


def _line(weight: float, bias: float) -> nn.Linear:
    line = nn.Linear(1, 2)
    with torch.no_grad():
        line.weight.fill_(weight)
        line.bias.copy_(torch.tensor([bias, -bias]))
    return line


def test_mixture_mixes_probabilities_for_classification_and_outputs_for_regression() -> None:
    first, second = _line(1.0, 0.5), _line(-2.0, 0.1)
    x = torch.tensor([[0.3], [-1.2]])
    classify = MixtureModel([first, second], [3.0, 1.0], "probabilities")
    expected = 0.75 * torch.softmax(first(x), -1) + 0.25 * torch.softmax(second(x), -1)
    torch.testing.assert_close(classify(x).exp(), expected)
    regress = MixtureModel([first, second], [3.0, 1.0], "outputs")
    torch.testing.assert_close(regress(x), 0.75 * first(x) + 0.25 * second(x))
    with pytest.raises(ValueError, match="not all zero"):
        MixtureModel([first], [0.0], "outputs")


def test_the_mixture_uses_evaluated_models_even_when_unseen_ones_lead_sampling() -> None:
    # Summed losses make every evaluated model look worse than the optimistic zero of unseen
    # ones: sampling explores those, but prediction must mix only models it has evaluated
    memory = _memory()
    config = FedericoConfig(beta=1.0)
    memory.observe({"me": 40.0, "a": 41.0}, config)
    assert memory.weights(config)[:2].max() < 1e-3  # sampling weights: unseen models lead
    mixture = memory.mixture_weights(config)
    np.testing.assert_allclose(mixture[:2], [1 / (1 + math.exp(-1.0)), 1 / (1 + math.exp(1.0))])
    assert mixture[2:].tolist() == [0.0, 0.0, 0.0]
    assert memory.members(config) == ["me", "a"]
