from collections import OrderedDict

import pytest
import torch
from torch import nn

from device_agent.training import StepBudget, TrainSpec, minibatches, train
from pfl_tasks.base import Split
from protocols.errors import TrainingError
from tests.squared_loss import SquaredLoss


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(hidden=nn.Linear(3, 4), act=nn.Tanh(), output=nn.Linear(4, 1)))


def _data(n: int = 23) -> Split:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(n, 3, generator=generator)
    return Split(inputs, inputs.sum(dim=1, keepdim=True))


def _spec(**changes: object) -> TrainSpec:
    values = {
        "trainable": ("hidden.weight", "hidden.bias", "output.weight", "output.bias"),
        "epochs": 2,
        "batch_size": 8,
        "lr": 0.1,
    }
    values.update(changes)
    return TrainSpec(**values)  # type: ignore[arg-type]


def test_micro_batches_accumulate_to_the_same_step_as_whole_batches() -> None:
    # Prepare
    whole, micro = _model(), _model()
    # Execute
    train(whole, SquaredLoss(), _data(), _spec(), torch.Generator().manual_seed(3))
    train(
        micro,
        SquaredLoss(),
        _data(),
        _spec(),
        torch.Generator().manual_seed(3),
        budget=StepBudget(micro_batch_size=3),
    )
    # Assert
    for (name, a), (_, b) in zip(
        whole.state_dict().items(), micro.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_step_budget_spans_epochs() -> None:
    # 23 samples at batch 8 = 3 steps per epoch; 5 epochs would be 15 steps
    stats = train(_model(), SquaredLoss(), _data(), _spec(epochs=5, max_steps=7), torch.Generator())
    assert stats.steps == 7
    assert stats.samples == 8 + 8 + 7 + 8 + 8 + 7 + 8


def test_frozen_parameters_do_not_move() -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train(
        model,
        SquaredLoss(),
        _data(),
        _spec(trainable=("output.weight", "output.bias")),
        torch.Generator(),
    )
    after = model.state_dict()
    torch.testing.assert_close(after["hidden.weight"], before["hidden.weight"])
    assert not torch.equal(after["output.weight"], before["output.weight"])


def test_non_finite_loss_raises_a_training_error() -> None:
    data = _data()
    poisoned = Split(data.inputs, data.targets.clone().fill_(float("inf")))
    with pytest.raises(TrainingError, match="loss"):
        train(_model(), SquaredLoss(), poisoned, _spec(), torch.Generator())


def test_minibatches_cover_every_sample_once_per_epoch() -> None:
    data = _data(10)
    seen = [x for x, _ in minibatches(data, 4, 2, torch.Generator().manual_seed(0))]
    assert [len(x) for x in seen] == [4, 4, 2, 4, 4, 2]
    first_epoch = torch.cat(seen[:3])
    assert sorted(first_epoch[:, 0].tolist()) == sorted(data.inputs[:, 0].tolist())


def test_per_tensor_learning_rates_scale_one_shared_gradient_step() -> None:
    # Prepare: one full-batch step; the output layer at 3x the step size of the hidden layer
    base, grouped = _model(), _model()
    before = {k: v.clone() for k, v in base.state_dict().items()}
    spec = _spec(epochs=1, batch_size=23)
    # Execute
    train(base, SquaredLoss(), _data(), spec, torch.Generator())
    train(
        grouped,
        SquaredLoss(),
        _data(),
        _spec(
            epochs=1,
            batch_size=23,
            lr_by_name={"output.weight": 0.3, "output.bias": 0.3},
        ),
        torch.Generator(),
    )
    # Assert: same gradient, so the moves differ by exactly the step-size ratio
    for name, value in before.items():
        ratio = 3.0 if name.startswith("output") else 1.0
        moved = grouped.state_dict()[name] - value
        torch.testing.assert_close(moved, ratio * (base.state_dict()[name] - value))
    assert all(p.grad is None for p in grouped.parameters())  # released after the phase


def test_learning_rates_for_tensors_that_do_not_train_are_refused() -> None:
    with pytest.raises(ValueError, match="do not train"):
        train(
            _model(),
            SquaredLoss(),
            _data(),
            _spec(trainable=("output.weight",), lr_by_name={"hidden.weight": 0.5}),
            torch.Generator(),
        )


def _torch_sgd(model: nn.Module, spec: TrainSpec, generator: torch.Generator) -> None:
    """The reference: torch.optim.SGD over the same minibatches."""
    optimizer = torch.optim.SGD(
        model.parameters(), lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay
    )
    for inputs, targets in minibatches(_data(), spec.batch_size, spec.epochs, generator):
        optimizer.zero_grad()
        SquaredLoss().loss(model(inputs), targets).backward()
        optimizer.step()


@pytest.mark.parametrize(
    "changes", [{}, {"momentum": 0.9}, {"weight_decay": 0.01}], ids=["plain", "momentum", "decay"]
)
def test_steps_are_bit_identical_to_torch_sgd(changes: dict[str, float]) -> None:
    # Prepare: plain SGD takes a direct path; momentum and weight decay use torch.optim.SGD
    ours, reference = _model(), _model()
    spec = _spec(**changes)
    # Execute
    train(ours, SquaredLoss(), _data(), spec, torch.Generator().manual_seed(5))
    _torch_sgd(reference, spec, torch.Generator().manual_seed(5))
    # Assert
    for (name, a), (_, b) in zip(
        ours.state_dict().items(), reference.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
