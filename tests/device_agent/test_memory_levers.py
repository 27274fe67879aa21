"""The memory plan's levers: micro-batching and gradient checkpointing, and its refusal."""

import pytest
import torch
from torch import nn

from benchmarks.memory_conv import GruClassifier, SignalTask, conv_block
from device_agent.checkpointing import blocks, checkpointed
from device_agent.memory_plan import (
    SAFETY_MARGIN,
    MemoryModel,
    activation_bytes_per_sample,
    checkpointed_bytes_per_sample,
    memory_model,
    plan_training,
)
from device_agent.training import StepBudget, TrainSpec, train
from pfl_tasks.base import Split
from pfl_tasks.split import ParamSplit
from protocols.errors import MemoryBudgetError


def _cnn(norm: bool, blocks: int = 3) -> nn.Sequential:
    """A small 1-D CNN over length-40 signals: expand-and-project blocks and a head."""
    torch.manual_seed(0)
    if norm:
        parts = [conv_block(1, width=32, outputs=4)]
        parts += [conv_block(4, width=32, outputs=4) for _ in range(blocks - 1)]
    else:  # the same blocks without BatchNorm
        parts = [
            nn.Sequential(nn.Conv1d(inputs, 32, 5, padding=2), nn.Tanh(), nn.Conv1d(32, 4, 1))
            for inputs in (1, 4, 4)
        ]
    head = nn.Sequential(nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(4, 10))
    return nn.Sequential(*parts, head)


def _gru() -> nn.Module:
    torch.manual_seed(0)
    return GruClassifier(hidden=12)


def _train(model: nn.Module, budget: StepBudget, model_name: str = "cnn", samples: int = 60):
    """Two epochs of SGD over `samples` signals in batches of 30; the training statistics."""
    task = SignalTask(model_name)
    data = task.signals(samples) if model_name == "gru" else _short(task.signals(samples))
    spec = TrainSpec(
        trainable=tuple(name for name, _ in model.named_parameters()),
        epochs=2,
        batch_size=30,
        lr=0.1,
    )
    return train(model, task, data, spec, torch.Generator().manual_seed(3), budget=budget)


def _short(split: Split) -> Split:
    """Length-40 signals for the small CNN."""
    return Split(split.inputs[:, :, :40].contiguous(), split.targets)


def _assert_same_state(left: nn.Module, right: nn.Module, **tolerance: float) -> None:
    for (name, value), other in zip(
        left.state_dict().items(), right.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(other, value, msg=name, **tolerance)  # type: ignore[arg-type]


@pytest.mark.parametrize(("build", "name"), [(lambda: _cnn(norm=False), "cnn"), (_gru, "gru")])
def test_micro_batches_give_the_whole_batch_update_for_convolutions_and_recurrences(
    build, name
) -> None:
    whole, micro = build(), build()
    _train(whole, StepBudget(), name)
    _train(micro, StepBudget(7), name)
    _assert_same_state(whole, micro, rtol=1e-5, atol=1e-6)


def test_checkpointing_gives_the_plain_update_batchnorm_statistics_included() -> None:
    # Recomputing a block in backward runs its BatchNorm again: without care the running
    # statistics would take a second momentum step and the counter would count twice
    plain, recomputed = _cnn(norm=True), _cnn(norm=True)
    _train(plain, StepBudget())
    _train(recomputed, StepBudget(checkpointing=True))
    _assert_same_state(plain, recomputed, rtol=1e-5, atol=1e-6)
    assert int(recomputed.state_dict()["0.1.num_batches_tracked"]) == 4  # 2 epochs x 2 batches


def test_with_batchnorm_micro_batches_normalize_and_count_per_micro_batch() -> None:
    # What changes with BatchNorm: statistics come from each micro-batch, and the running
    # statistics take one step per micro-batch, so the update is not the whole batch's
    whole, micro = _cnn(norm=True), _cnn(norm=True)
    _train(whole, StepBudget())
    _train(micro, StepBudget(10))
    assert int(micro.state_dict()["0.1.num_batches_tracked"]) == 4 * 3
    first = "0.0.weight"
    assert not torch.allclose(
        whole.state_dict()[first], micro.state_dict()[first], rtol=1e-4, atol=1e-6
    )


def test_checkpointing_needs_a_sequence_of_blocks() -> None:
    assert blocks(_gru()) is None
    assert blocks(nn.Sequential(nn.Linear(2, 2))) is None
    with pytest.raises(ValueError, match=r"not an nn\.Sequential of blocks"):
        checkpointed(_gru())


def test_checkpointed_blocks_keep_their_boundaries_and_the_largest_block() -> None:
    task = SignalTask("cnn")
    data = _short(task.signals(8))
    model = _cnn(norm=True)
    plain = activation_bytes_per_sample(model, task, data)
    recomputed = checkpointed_bytes_per_sample(model, task, data)
    assert recomputed is not None
    # blocks of 32-channel internals between 4-channel boundaries over 40 steps: three blocks'
    # internals plainly, one block's plus the boundaries checkpointed
    assert recomputed < plain / 2
    assert recomputed > 4 * 40 * (1 + 4 + 4)  # at least the three blocks' inputs
    assert checkpointed_bytes_per_sample(_gru(), SignalTask("gru"), task.signals(4)) is None


def test_probing_leaves_batchnorm_statistics_as_they_were() -> None:
    model = _cnn(norm=True)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    task = SignalTask("cnn")
    memory_model(model, task, _short(task.signals(200)), ParamSplit.for_model(model, ()))
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def _budget(usable: int) -> int:
    """The budget whose usable part (less the safety margin) is `usable`, at runtime 0."""
    return int(usable / (1 - SAFETY_MARGIN)) + 1


@pytest.mark.parametrize(
    ("usable", "checkpointed", "expected"),
    [
        (100_000, 400, (False, 100, 1)),  # the whole batch fits plainly
        (60_000, 400, (True, 100, 1)),  # plainly 60 x 2, checkpointed 100 x 1
        (60_000, 700, (False, 60, 2)),  # checkpointed 85 x 2: a tie, plain does not recompute
        (30_000, 700, (False, 30, 4)),  # checkpointed 42 x 3: not half of 4, plain
        (60_000, None, (False, 60, 2)),  # no blocks to checkpoint
        (500, 400, (True, 1, 100)),  # not one sample plainly, one checkpointed
    ],
)
def test_the_plan_checkpoints_where_that_halves_the_micro_batches(
    usable: int, checkpointed: int | None, expected: tuple[bool, int, int]
) -> None:
    terms = MemoryModel(0, 0, 0, 1_000, checkpointed_bytes_per_sample=checkpointed)
    plan = plan_training(terms, _budget(usable), batch_size=100)
    assert (plan.checkpointing, plan.micro_batch_size, plan.accumulation_steps) == expected
    assert plan.estimated_peak_bytes <= usable


def test_a_budget_that_fits_no_sample_even_checkpointed_is_refused_with_the_numbers() -> None:
    mib = 2**20
    terms = MemoryModel(
        300 * mib, 2 * mib, 0, mib // 2, checkpointed_bytes_per_sample=mib // 4,
        step_overhead_bytes=mib,
    )  # fmt: skip
    with pytest.raises(MemoryBudgetError) as refused:
        plan_training(terms, 256 * 10**6, batch_size=64)
    assert str(refused.value) == (
        "memory budget 244.1 MiB cannot fit local training: it needs 303.5 MiB at a micro-batch "
        "of 1 (303.2 MiB with gradient checkpointing) (runtime 300.0 MiB, parameters and "
        "gradients 2.0 MiB, a step's overhead 1.0 MiB, activations 0.50 MiB a sample) and a "
        "10% margin; raise "
        "--memory-budget or personalize fewer parameters"
    )
    without_blocks = MemoryModel(300 * mib, 2 * mib, 0, mib // 2)
    with pytest.raises(MemoryBudgetError, match=r"no nn\.Sequential of blocks"):
        plan_training(without_blocks, 256 * 10**6, batch_size=64)


def test_a_tight_budget_plans_checkpointing_and_the_round_trains_as_planned() -> None:
    # Prepare: counted (not probed) terms of a deeper BatchNorm CNN (the count's allowance for
    # the allocator leaves three blocks too little to gain) and a budget that fits a batch of 30
    # checkpointed, and not half of it plainly
    task = SignalTask("cnn")
    data = _short(task.signals(60))
    model = _cnn(norm=True, blocks=6)
    split = ParamSplit.for_model(model, ())
    terms = memory_model(model, task, data, split, runtime_bytes=0, probe=False)
    usable = terms.peak(30, checkpointing=True)
    assert terms.peak(15) > usable
    plan = plan_training(terms, _budget(usable), batch_size=30)
    assert (plan.checkpointing, plan.micro_batch_size) == (True, 30)
    # Execute
    stats = _train(model, StepBudget(plan.micro_batch_size, checkpointing=plan.checkpointing))
    # Assert: every step ran, and the update is the plain one
    reference = _cnn(norm=True, blocks=6)
    assert stats.steps == _train(reference, StepBudget()).steps == 4
    _assert_same_state(reference, model, rtol=1e-5, atol=1e-6)
