import pytest
import torch

from device_agent.memory_plan import (
    SAFETY_MARGIN,
    MemoryModel,
    activation_bytes_per_sample,
    for_split,
    memory_model,
    parse_memory_budget,
    plan_training,
)
from device_agent.training import StepBudget, TrainSpec, train
from pfl_tasks.base import PartitionSpec
from pfl_tasks.digits import DigitsTask
from pfl_tasks.split import ParamSplit
from protocols.algorithms import FedericoConfig
from protocols.errors import MemoryBudgetError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MB", 512 * 10**6),
        ("1.5GiB", int(1.5 * 2**30)),
        ("70%", 700),
        ("0.25", 250),
        ("2048", 2048),
    ],
)
def test_budgets_parse_as_sizes_percentages_or_fractions(text: str, expected: int) -> None:
    assert parse_memory_budget(text, available_bytes=1000) == expected


@pytest.mark.parametrize("text", ["lots", "12 parsecs", "-5MB", "150%", ""])
def test_bad_budgets_are_refused_with_a_clear_message(text: str) -> None:
    with pytest.raises(ValueError, match="memory budget"):
        parse_memory_budget(text, available_bytes=1000)


def _setup(hidden: int = 64):
    task = DigitsTask(hidden=hidden)
    model = task.build_model(0)
    data = task.make_fleet(4, PartitionSpec(scheme="iid"), 0)[0]
    return task, model, data


def test_probe_counts_the_tensors_backprop_keeps() -> None:
    # An MLP 64 -> h -> 10 keeps per sample its float32 input, the ReLU output, the logits and
    # the loss's own buffers: only the ReLU output depends on h, by 4 bytes per unit.
    measured = {}
    for hidden in (32, 256):
        task, model, data = _setup(hidden)
        measured[hidden] = activation_bytes_per_sample(model, task, data.train)
        assert measured[hidden] >= 4 * (64 + hidden + 10)
    assert measured[256] - measured[32] == 4 * (256 - 32)


def test_plan_takes_the_largest_micro_batch_that_fits() -> None:
    task, model, data = _setup()
    split = ParamSplit.for_model(model, ())
    terms = memory_model(model, task, data.train, split, runtime_bytes=0)
    roomy = int(terms.peak(64) / (1 - SAFETY_MARGIN)) + 1
    tight = int(terms.peak(5) / (1 - SAFETY_MARGIN)) + 1  # runtime 0: the margin is 10% of all
    assert plan_training(terms, roomy, batch_size=32).micro_batch_size == 32
    plan = plan_training(terms, tight, batch_size=32)
    assert plan.micro_batch_size == 5
    assert plan.accumulation_steps == 7
    assert plan.estimated_peak_bytes <= tight


def test_a_budget_below_one_sample_is_refused_before_training() -> None:
    task, model, data = _setup()
    terms = memory_model(
        model, task, data.train, ParamSplit.for_model(model, ()), runtime_bytes=10**6
    )
    with pytest.raises(MemoryBudgetError, match="micro-batch of 1"):
        plan_training(terms, budget_bytes=10**6, batch_size=10)


def test_a_round_plans_four_model_sizes_whatever_the_split() -> None:
    # Measured (benchmarks/memory.py, modes table): a round holds 3.5-3.9 model sizes over the
    # runtime in every personalization mode, so the split moves nothing; a model twice as large
    # (the paper's full personalization: a shared and a personal copy) plans twice as much.
    task, model, data = _setup()
    names = list(model.state_dict())
    size = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    terms = memory_model(model, task, data.train, ParamSplit.for_model(model, ()), runtime_bytes=0)
    for patterns in ((), ("output.*",), ("*",)):
        split = ParamSplit.from_patterns(names, patterns)
        assert for_split(terms, model, split).parameter_bytes == 4 * size
    assert (
        for_split(terms, model, ParamSplit.for_model(model, ()), momentum=True).optimizer_bytes
        == size
    )


def test_planned_micro_batches_give_the_gradients_of_the_whole_batch() -> None:
    # Prepare: a budget that forces micro-batching of a batch of 30
    task, model, data = _setup()
    terms = memory_model(model, task, data.train, ParamSplit.for_model(model, ()), runtime_bytes=0)
    plan = plan_training(terms, int(terms.peak(7) / (1 - SAFETY_MARGIN)) + 1, batch_size=30)
    assert plan.micro_batch_size == 7
    whole, micro = task.build_model(0), task.build_model(0)
    spec = TrainSpec(
        trainable=tuple(n for n, _ in whole.named_parameters()), epochs=1, batch_size=30, lr=0.1
    )
    # Execute
    train(whole, task, data.train, spec, torch.Generator().manual_seed(1))
    train(
        micro,
        task,
        data.train,
        spec,
        torch.Generator().manual_seed(1),
        budget=StepBudget(plan.micro_batch_size),
    )
    # Assert
    for name, value in whole.state_dict().items():
        torch.testing.assert_close(micro.state_dict()[name], value, rtol=1e-5, atol=1e-6)


def test_a_relay_round_plans_four_copies_of_each_model_it_holds() -> None:
    # FedeRiCo holds its own model and M peers: received bytes, decoded tensors, weighted
    # contribution and its encoding, each a whole model
    model = DigitsTask().build_model(0)
    everything = ParamSplit.for_model(model, ())
    size = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    measured = MemoryModel(10_000_000, 0, 0, 1_000)
    plain = for_split(measured, model, everything)
    relay = for_split(
        measured, model, everything, relayed_models=FedericoConfig(neighbours=3).relayed_models()
    )
    assert relay.parameter_bytes - plain.parameter_bytes == 4 * 4 * size
    assert FedericoConfig(neighbours=0).relayed_models() == 1
