"""The `--model` setting: a task's declared models, the BatchNorm CNN, and what is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from coordinator.run.settings import ServeSettings, SimulationSettings
from pfl_tasks.mnist1d_task import generate_mnist1d
from pfl_tasks.registry import load_task, offered_models, options_with_model
from protocols.settings_errors import SettingsError


def test_tasks_declare_the_models_they_offer() -> None:
    assert offered_models("mnist1d") == ("cnn", "cnn-bn", "cnn-paper", "gru", "mlp", "linear")
    assert offered_models("digits") == ("mlp", "split-input", "linear")
    assert offered_models("synthetic") == ("mlp", "mclr")
    assert offered_models("sine") == ()
    assert offered_models("digits-image") == ()
    assert offered_models("tests.pfl_tasks.test_model_option:TwoModels") == ("small", "big")


class TwoModels:
    """A user task class that offers two models (only its declaration is read here)."""

    models = ("small", "big")


def test_the_model_setting_becomes_the_task_option() -> None:
    # Execute
    settings = SimulationSettings.load(None, task="mnist1d", model="gru")
    untouched = SimulationSettings.load(None, task="mnist1d", task_options={"shift": "feature"})
    both = SimulationSettings.load(
        None, task="mnist1d", model="mlp", task_options={"model": "mlp", "hidden": 8}
    )

    # Assert: the same task a [task_options] table would build
    assert settings.task_options == {"model": "gru"}
    model = load_task(settings.task, settings.task_options).build_model(0)
    assert isinstance(model.input, nn.GRU)
    assert untouched.task_options == {"shift": "feature"}
    assert both.task_options == {"model": "mlp", "hidden": 8}
    assert ServeSettings.load(None, task="digits", model="linear").task_options == {
        "model": "linear"
    }


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"task": "mnist1d", "model": "lstm"},
            "unknown model 'lstm' for task 'mnist1d'; "
            "valid models: cnn, cnn-bn, cnn-paper, gru, mlp, linear",
        ),
        ({"task": "sine", "model": "cnn"}, "task 'sine' offers no choice of model"),
        ({"task": "gaussian", "model": "mlp"}, "its model is fixed"),
        (
            {"task": "mnist1d", "model": "gru", "task_options": {"model": "cnn"}},
            "--model gru contradicts task option model = 'cnn'",
        ),
        ({"task": "nosuchtask", "model": "cnn"}, "unknown task 'nosuchtask'"),
    ],
)
def test_a_model_the_task_does_not_offer_is_refused_with_the_reason(
    values: dict[str, object], message: str
) -> None:
    with pytest.raises(SettingsError, match=message):
        SimulationSettings.load(None, **values)


def test_options_without_a_model_pass_unchanged() -> None:
    options = {"shift": "feature"}
    assert options_with_model("sine", options, None) == options
    assert options_with_model("mnist1d", options, "cnn") == {"shift": "feature", "model": "cnn"}


def test_the_batchnorm_cnn_has_running_statistics_and_the_cnns_layout() -> None:
    # Execute
    bn = load_task("mnist1d", {"model": "cnn-bn"}).build_model(0)
    group = load_task("mnist1d", {"model": "cnn"}).build_model(0)
    signals = generate_mnist1d().test.inputs[:8]

    # Assert: BatchNorm1d where the CNN has GroupNorm, same parameter count, same names
    assert isinstance(bn.norm1, nn.BatchNorm1d)
    state = bn.state_dict()
    assert state["norm3.num_batches_tracked"].dtype == torch.int64
    assert {"norm1.running_mean", "norm2.running_var"} <= set(state)
    assert sum(p.numel() for p in bn.parameters()) == sum(p.numel() for p in group.parameters())
    assert {n for n, _ in bn.named_parameters()} == {n for n, _ in group.named_parameters()}
    bn.train()
    bn(signals).sum().backward()
    assert int(bn.state_dict()["norm1.num_batches_tracked"]) == 1
    bn.eval()
    assert bn(signals).shape == (8, 10)
