"""Adapters (spec §2.2) and the split-input MLP (spec §2.1, Fig. 1c)."""

from collections.abc import Callable

import pytest
import torch
from torch import nn

from pfl_tasks.digits import DigitsTask
from pfl_tasks.models import SplitInputMLP, build_mlp, insert_adapters, make_mlp
from pfl_tasks.registry import load_task
from pfl_tasks.synthetic import SyntheticTask


def _inputs() -> torch.Tensor:
    return torch.rand(32, 64, generator=torch.Generator().manual_seed(1))


def test_adapters_start_near_the_identity() -> None:
    # Prepare
    plain = build_mlp(0, 64, 64, 10)
    adapted = build_mlp(0, 64, 64, 10, adapters=16)
    x = _inputs()
    # Execute
    with torch.no_grad():
        without, with_adapters = plain(x), adapted(x)
    # Assert: the original layers are untouched and the output barely moves
    for name, value in plain.state_dict().items():
        assert torch.equal(adapted.state_dict()[name], value)
    relative = (with_adapters - without).norm() / without.norm()
    assert 0 < relative < 1e-2


def test_adapters_with_zero_weights_are_exactly_the_identity() -> None:
    plain = build_mlp(0, 64, 64, 10)
    adapted = build_mlp(0, 64, 64, 10, adapters=16)
    with torch.no_grad():
        adapted.get_parameter("act_adapter.down.weight").zero_()
        adapted.get_parameter("act_adapter.up.weight").zero_()
        assert torch.equal(adapted(_inputs()), plain(_inputs()))


def test_adapter_init_is_one_draw_per_seed() -> None:
    # Prepare
    first, again, other = (DigitsTask(adapters=16).build_model(s) for s in (3, 3, 4))
    down = "act_adapter.down.weight"
    # Assert: identical for every device built from the same seed, different for another seed
    for name, value in first.state_dict().items():
        assert torch.equal(again.state_dict()[name], value)
    assert not torch.equal(first.state_dict()[down], other.state_dict()[down])
    weights = torch.cat(
        [first.state_dict()[down].flatten(), first.state_dict()["act_adapter.up.weight"].flatten()]
    )
    assert 0.008 < float(weights.std()) < 0.012
    assert not first.state_dict()["act_adapter.down.bias"].any()
    assert not first.state_dict()["act_adapter.up.bias"].any()


def test_insert_adapters_caps_the_bottleneck_and_spares_the_global_rng() -> None:
    mlp = make_mlp(5, 8, 2)
    state = torch.random.get_rng_state()
    model = insert_adapters(mlp, bottleneck=16, seed=0)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert model.get_parameter("act_adapter.down.weight").shape == (8, 8)
    assert [name for name, _ in model.named_children()] == [
        "hidden",
        "act",
        "act_adapter",
        "output",
    ]


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: insert_adapters(SplitInputMLP(2, 2, 4, 3), 4, 0), "nn.Sequential"),
        (lambda: insert_adapters(nn.Sequential(nn.Linear(3, 2)), 4, 0), "hidden activation"),
        (lambda: insert_adapters(make_mlp(3, 4, 2), 0, 0), "bottleneck"),
        (lambda: DigitsTask(adapters=-1), "adapters must be an integer >= 0"),
        (lambda: DigitsTask(model="split-input", adapters=4), "mlp model only"),
        (lambda: SyntheticTask(model="mclr", adapters=4), "hidden layer"),
        (lambda: DigitsTask(model="cnn"), "valid choices: mlp, split-input"),  # type: ignore[arg-type]
    ],
)
def test_impossible_adapter_or_model_options_are_value_errors(
    factory: Callable[[], object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        factory()


def test_task_options_reach_the_model_through_the_registry() -> None:
    digits = load_task("digits", {"adapters": 8}).build_model(0)
    synthetic = load_task("synthetic", {"adapters": 8, "hidden": 4}).build_model(0)
    assert digits.get_parameter("act_adapter.down.weight").shape == (8, 64)
    assert synthetic.get_parameter("act_adapter.down.weight").shape == (4, 4)


def test_split_input_model_embeds_the_bottom_half_only_through_the_private_branch() -> None:
    # Prepare
    model = DigitsTask(model="split-input", hidden=16).build_model(0)
    x = _inputs()
    top_changed, bottom_changed = x.clone(), x.clone()
    top_changed[:, :32] += 1.0
    bottom_changed[:, 32:] += 1.0
    # Execute: silence the private branch
    with torch.no_grad():
        model.get_parameter("private_input.weight").zero_()
        base, top, bottom = model(x), model(top_changed), model(bottom_changed)
    # Assert
    assert torch.equal(base, bottom)
    assert not torch.allclose(base, top)
    assert base.shape == (32, 10)
