"""pFedMe and pFedBreD trained stacked: the per-device path's results, prior by prior.

Tolerance as for the other families (tests/device_agent/test_batched.py): sums in another order
leave float32 rounding, so after 2 rounds weights and stored theta and memory agree to 1e-5
(absolute) and losses and metrics to 1e-5 (relative).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

from device_agent.algorithms.base import LocalContext
from device_agent.algorithms.pfedbred import PFedBreDUpdate
from pfl_tasks.base import DeviceData, Split
from pfl_tasks.registry import load_task
from pfl_tasks.split import ParamSplit
from protocols.algorithms import PFedBreDConfig
from protocols.errors import RoundError
from tests.device_agent.test_batched import _assert_same_run, _run

pytestmark = pytest.mark.timeout(300)

TOLERANCE = 1e-5

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {  # mu = w; SGD with momentum and clipping
    "pfedme": ("pfedme", {"momentum": 0.5, "clip_grad_norm": 0.5, "batch_size": 8}),
    "meg": ("pfedbred", {"prior": "meg", "weight_decay": 1e-3}),
    "mh": ("pfedbred", {"prior": "mh", "batch_size": 8}),  # look-ahead, a second minibatch
    "mh_simple": ("pfedbred", {"prior": "mh_simple", "meta_step_updates_w": False}),
    "lg": ("pfedbred", {"prior": "lg", "prox_init": "prev_theta"}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_stacked_rounds_equal_the_per_device_path(variant: str) -> None:
    # Arrange: the power-law fleet's 6 devices hold unequal numbers of samples
    algorithm, options = VARIANTS[variant]
    values = {"algorithm_options": {"local_steps": 4, "prox_steps": 3, **options}}
    # Execute
    per_device, none = _run(algorithm, "off", **values)
    batched, trainer = _run(algorithm, "on", **values)
    # Assert: every device round of both rounds trained stacked, to the same w, theta and memory
    assert none is None
    assert trainer is not None
    assert trainer.stacked_rounds == sum(r.participants for r in batched.records)
    assert trainer.stacked_rounds == 12
    _assert_same_run(per_device, batched)


def test_auto_stacks_their_rounds_to_the_per_device_results() -> None:
    # Execute: pFedBreD (mh) under `auto`, whose step is cheap enough to batch, and `off`
    values = {"algorithm_options": {"local_steps": 4, "prox_steps": 3}}
    per_device, _ = _run("pfedbred", "off", **values)
    automatic, trainer = _run("pfedbred", "auto", **values)
    # Assert: `auto` trains every device round stacked, to the per-device results
    assert trainer is not None
    assert trainer.stacked_rounds == sum(r.participants for r in automatic.records) == 12
    _assert_same_run(per_device, automatic)


MODELS = {  # batched matrix products; anything else runs under vmap
    "mlp": lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)),
    "vmap": lambda: nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)),
}


def _contexts(sizes: list[int], seed: int, kind: str) -> list[LocalContext]:
    """Devices of `sizes` samples sharing one workspace model, with their own generators."""
    torch.manual_seed(seed)
    model = MODELS[kind]()
    shared = {name: value.detach().clone() for name, value in model.state_dict().items()}
    config = PFedBreDConfig(prior="mh", batch_size=4, local_steps=3, prox_steps=2)
    contexts = []
    for d, size in enumerate(sizes):
        split = Split(torch.randn(size, 3), torch.randint(0, 2, (size,)))
        contexts.append(
            LocalContext(
                model=model,
                task=load_task("synthetic"),
                data=DeviceData(d, split, split, split),
                split=ParamSplit.for_model(model, ()),
                config=config,
                global_shared=shared,
                personal={},
                generator=torch.Generator().manual_seed(100 + d),
                device_id=f"d{d}",
            )
        )
    return contexts


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_device_without_data_and_devices_of_every_size_match_their_own_runs(kind: str) -> None:
    # Arrange: 0 samples (no iteration), fewer than a batch, uneven epochs
    sizes = [5, 0, 2, 9, 4]
    update = PFedBreDUpdate()
    alone = []
    for ctx in _contexts(sizes, seed=1, kind=kind):
        ctx.model.load_state_dict(ctx.global_shared)
        alone.append((update.run(ctx), ctx.generator.get_state()))
    # Execute
    contexts = _contexts(sizes, seed=1, kind=kind)
    stacked = update.run_stacked(contexts)
    # Assert: results, kept theta and memory, and each generator's state afterwards
    for (one, generator), other, ctx in zip(alone, stacked, contexts, strict=True):
        assert one.state.keys() == other.state.keys()
        for name in one.state:
            assert torch.allclose(one.state[name], other.state[name], atol=TOLERANCE, rtol=0)
        for name in one.shared_delta:
            delta, twin = one.shared_delta[name], other.shared_delta[name]
            assert torch.allclose(delta, twin, atol=TOLERANCE, rtol=0)
        assert one.num_samples == other.num_samples
        assert one.train_loss == pytest.approx(other.train_loss, rel=TOLERANCE)
        assert torch.equal(generator, ctx.generator.get_state())
    assert all(r.train_loss > 0 for r, size in zip(stacked, sizes, strict=True) if size)
    assert stacked[1].train_loss == 0.0
    assert all(float(t.abs().max()) == 0.0 for t in stacked[1].shared_delta.values())


def test_diverging_devices_decline_as_on_the_per_device_path(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Execute: a personal step size that makes every device's loss non-finite in round 1
    options = {"algorithm_options": {"personal_lr": 1e30, "local_steps": 2}}
    with pytest.raises(RoundError) as per_device:
        _run("pfedme", "off", **options)
    with caplog.at_level(logging.INFO), pytest.raises(RoundError) as batched:
        _run("pfedme", "on", **options)
    # Assert: the stacked rounds gave up, each device trained alone and declined with its reason
    assert str(batched.value) == str(per_device.value)
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("batched training: stacked training failed") for m in said)
    declined = {m for m in said if m.endswith("train round 1 failed: training loss became nan")}
    assert len(declined) == 6
