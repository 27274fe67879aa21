"""The stacked path's minibatch layout and forward: the per-device loop's draws and outputs."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from device_agent.algorithms.base import BatchPhase
from device_agent.batched.flat_sgd import FlatLayout
from device_agent.batched.forward import stacked_forward
from device_agent.batched.schedule import schedule
from device_agent.batched.stacked import Member, train_stacked
from device_agent.training import TrainSpec, minibatches
from pfl_tasks.base import Split
from pfl_tasks.registry import load_task


def _per_device(count: int, spec: TrainSpec, seed: int) -> tuple[list[torch.Tensor], bytes]:
    """The sample indices of each step as `train` draws them, and the generator's state after."""
    generator = torch.Generator().manual_seed(seed)
    positions = Split(torch.arange(count), torch.arange(count))
    steps: list[torch.Tensor] = []
    if count and spec.trainable:
        for index, _ in minibatches(positions, spec.batch_size, spec.epochs, generator):
            if spec.max_steps is not None and len(steps) >= spec.max_steps:
                break
            steps.append(index)
    return steps, bytes(generator.get_state().numpy())


@pytest.mark.parametrize(
    ("epochs", "max_steps"), [(1, None), (3, None), (2, 0), (2, 3), (3, 4), (2, 100)]
)
def test_every_device_draws_the_per_device_minibatches(epochs: int, max_steps: int | None) -> None:
    # Arrange: devices of unequal sizes, an empty one among them
    counts = [7, 0, 12, 3, 10]
    spec = TrainSpec(("w",), epochs, 4, 0.1, max_steps=max_steps)
    generators = [torch.Generator().manual_seed(i) for i in range(len(counts))]
    # Execute
    plan = schedule(counts, spec, generators)
    # Assert: device d's real positions at step s are its own step s, offset into the concatenation
    offsets = [sum(counts[:d]) for d in range(len(counts))]
    for device, count in enumerate(counts):
        expected, state = _per_device(count, spec, device)
        assert plan.steps[device] == len(expected)
        assert plan.samples[device] == sum(len(step) for step in expected)
        assert bytes(generators[device].get_state().numpy()) == state
        for step in range(plan.index.shape[0]):
            chosen = plan.index[step, device][plan.mask[step, device]] - offsets[device]
            want = expected[step] if step < len(expected) else torch.zeros(0, dtype=torch.long)
            assert torch.equal(chosen, want)
    assert torch.equal(plan.active, plan.mask.any(dim=2))


def test_padding_points_at_samples_that_exist() -> None:
    # Execute: the last device is empty, so its own first sample would be past the end
    plan = schedule([5, 0], TrainSpec(("w",), 1, 4, 0.1), [torch.Generator(), torch.Generator()])
    # Assert
    assert int(plan.index.max()) <= 4


def test_the_matrix_product_forward_equals_each_model_on_its_batch() -> None:
    # Arrange: three devices' MLPs (with a flatten and a bias-free layer) and their batches
    model = nn.Sequential(
        OrderedDict(
            flat=nn.Flatten(),
            hidden=nn.Linear(6, 5),
            act=nn.Tanh(),
            output=nn.Linear(5, 3, bias=False),
        )
    )
    devices = []
    for seed in range(3):
        torch.manual_seed(seed)
        devices.append({k: torch.randn_like(v) for k, v in model.state_dict().items()})
    inputs = torch.randn(3, 4, 2, 3)
    forward, transposed = stacked_forward(model)
    layout = FlatLayout(model, transposed)
    # Execute
    outputs = forward(layout.views(layout.stack(devices)), inputs)
    # Assert: what each model computes alone, and the stored rows read back unchanged
    assert transposed == {"hidden.weight", "output.weight"}
    for device, values in enumerate(devices):
        model.load_state_dict(values)
        with torch.no_grad():
            alone = model(inputs[device])
        assert torch.allclose(outputs[device], alone, atol=1e-6)
    for row, values in zip(layout.rows(layout.stack(devices)), devices, strict=True):
        assert row.keys() == values.keys()
        assert all(torch.equal(row[k], values[k]) for k in values)


def test_other_models_run_under_vmap_with_nothing_transposed() -> None:
    # Arrange
    model = nn.Sequential(nn.Conv1d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16, 2))
    forward, transposed = stacked_forward(model)
    layout = FlatLayout(model, transposed)
    values = {k: v.clone() for k, v in model.state_dict().items()}
    inputs = torch.randn(2, 3, 1, 10)
    # Execute
    outputs = forward(layout.views(layout.stack([values, values])), inputs)
    # Assert
    assert transposed == frozenset()
    with torch.no_grad():
        assert torch.allclose(outputs[1], model(inputs[1]), atol=1e-6)


def test_a_phase_naming_a_tensor_that_is_no_parameter_is_refused() -> None:
    # Arrange
    model = nn.Sequential(OrderedDict(output=nn.Linear(2, 2)))
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    split = Split(torch.zeros(3, 2), torch.zeros(3, dtype=torch.long))
    member = Member(split, torch.Generator(), start, start)
    phase = BatchPhase(TrainSpec(("output.weight", "missing"), 1, 2, 0.1))
    # Execute / Assert: refused before any draw, so the per-device fallback draws the same
    with pytest.raises(ValueError, match="not parameters"):
        train_stacked(model, load_task("digits"), [member], (phase,))
    assert torch.equal(member.generator.get_state(), torch.Generator().get_state())


def test_rows_sharing_the_received_tensors_stack_as_copies_of_them_do() -> None:
    # Arrange: an MLP (its weights stored transposed); rows 0-2 share one tensor of each name
    model = nn.Sequential(OrderedDict(hidden=nn.Linear(3, 4), act=nn.ReLU(), out=nn.Linear(4, 2)))
    layout = FlatLayout(model, stacked_forward(model)[1])
    received = {k: v.detach().clone() for k, v in model.named_parameters()}
    personal = {**received, "out.bias": torch.tensor([5.0, 6.0])}
    rows = [received, received, received, personal]
    copies = [{k: v.clone() for k, v in row.items()} for row in rows]
    # Execute
    stacked = layout.stack(rows)
    # Assert: the same values, in a tensor of its own (training it leaves the received alone)
    assert torch.equal(stacked, layout.stack(copies))
    stacked.add_(1.0)
    assert all(torch.equal(received[k], copies[0][k]) for k in received)
