from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from device_agent.algorithms.base import LocalContext
from device_agent.algorithms.pfedbred import PFedBreDUpdate, PFedMeUpdate
from device_agent.algorithms.proximal_prior import MEMORY
from device_agent.algorithms.theta import THETA
from pfl_tasks.base import DeviceData, Split
from pfl_tasks.split import ParamSplit
from protocols.algorithms import PFedBreDConfig, PFedMeConfig, PriorRule
from tests.device_agent.algorithms.linear_problem import LeastSquares

Arrays = dict[str, np.ndarray]

NAMES = ("output.weight", "output.bias")


def _data(n: int = 12, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3))
    y = x @ np.array([[1.0, 0.2], [-2.0, 0.4], [0.5, -1.0]]) + np.array([0.3, -0.1])
    return x, y + 0.1 * rng.normal(size=y.shape)


def _context(config, x, y, *, state=None, seed=0, model_seed=0, task=None) -> LocalContext:
    torch.manual_seed(model_seed)
    model = nn.Sequential(OrderedDict(output=nn.Linear(3, 2))).double()
    split = Split(torch.tensor(x), torch.tensor(y))
    if task is not None:
        task.model = model
    return LocalContext(
        model=model,
        task=task or LeastSquares(),
        data=DeviceData(0, split, split, split),
        split=ParamSplit(shared=NAMES, personal=()),
        config=config,
        global_shared={k: v.detach().clone() for k, v in model.state_dict().items()},
        personal={},
        generator=torch.Generator().manual_seed(seed),
        state=dict(state or {}),
    )


def _grad(x: np.ndarray, y: np.ndarray, p: Arrays) -> Arrays:
    """Full-batch gradient of mean((x W^T + b - y)^2) over all outputs."""
    r = x @ p["output.weight"].T + p["output.bias"] - y
    d = 2.0 / r.size * r
    return {"output.weight": d.T @ x, "output.bias": d.sum(axis=0)}


def _lin(a: Arrays, s: float, b: Arrays) -> Arrays:
    return {k: a[k] + s * b[k] for k in a}


def _reference(x, y, w, theta, memory, cfg) -> tuple[Arrays, Arrays]:
    """ClientUpdate_i of spec §2.2 by hand on the full batch (every minibatch is all of it)."""
    eta, eta_a = getattr(cfg, "eta", 0.0), getattr(cfg, "eta_alpha", 0.0)
    rule = getattr(cfg, "prior", "identity")
    for _ in range(cfg.local_steps):
        if rule == "identity":
            mu, start = w, w
        elif rule == "lg":
            mu = _lin(w, -eta_a, _grad(x, y, w))
            start = mu
        elif rule == "meg":
            mu, start = _lin(w, -eta, _lin(memory, -1.0, theta)), w
        else:
            g = _grad(x, y, w)
            if rule == "mh":
                g = _grad(x, y, _lin(w, -eta_a, g))
            ahead = _lin(w, -eta_a, g)
            if cfg.meta_step_updates_w:
                w = ahead
            mu, start = _lin(ahead, -eta, _lin(memory, -1.0, theta)), w
        theta = start
        for _ in range(cfg.prox_steps):
            step = _lin(_grad(x, y, theta), cfg.lam, _lin(theta, -1.0, mu))
            theta = _lin(theta, -cfg.personal_lr, step)
        w = _lin(w, -cfg.lr * cfg.lam, _lin(mu, -1.0, theta))
    return w, theta


def _stored(prefix: str, tensors: Arrays) -> dict[str, torch.Tensor]:
    return {prefix + k: torch.tensor(v) for k, v in tensors.items()}


PRIORS: list[tuple[PriorRule, bool]] = [
    ("identity", True),
    ("lg", True),
    ("meg", True),
    ("mh", True),
    ("mh", False),
    ("mh_simple", True),
    ("mh_simple", False),
]


@pytest.mark.parametrize(("prior", "moves_w"), PRIORS)
@pytest.mark.parametrize("with_state", [False, True])
def test_each_prior_matches_the_hand_computed_round(prior, moves_w, with_state) -> None:
    # Prepare: full batch, R = 3, K = 2, large eta's so every term shows; stored theta and
    # memory that differ from w (and from each other) when with_state
    x, y = _data()
    cfg = PFedBreDConfig(
        prior=prior, meta_step_updates_w=moves_w, local_steps=3, prox_steps=2, batch_size=12,
        lr=0.02, personal_lr=0.03, lam=4.0, eta=0.3, eta_alpha=0.1,
    )  # fmt: skip
    ctx = _context(cfg, x, y)
    w0 = {k: v.numpy().copy() for k, v in ctx.global_shared.items()}
    theta0, memory0 = dict(w0), dict(w0)
    if with_state:
        rng = np.random.default_rng(5)
        theta0 = {k: v + rng.normal(size=v.shape) for k, v in w0.items()}
        memory0 = {k: v + rng.normal(size=v.shape) for k, v in w0.items()}
        ctx.state = {**_stored(THETA, theta0), **_stored(MEMORY, memory0)}
    # Execute
    result = PFedBreDUpdate().run(ctx)
    # Assert: delta, theta and the memory (= the final w) all follow the closed form
    w, theta = _reference(x, y, w0, theta0, memory0, cfg)
    for name in NAMES:
        np.testing.assert_allclose(result.shared_delta[name].numpy(), w[name] - w0[name], rtol=1e-9)
        np.testing.assert_allclose(result.state[THETA + name].numpy(), theta[name], rtol=1e-9)
        np.testing.assert_allclose(result.state[MEMORY + name].numpy(), w[name], rtol=1e-9)
    assert result.num_samples == 12
    assert set(result.state) == {THETA + n for n in NAMES} | {MEMORY + n for n in NAMES}


def test_the_priors_are_told_apart_by_the_reference() -> None:
    # Guard: the closed forms above separate the strategies (no two coincide on this problem)
    x, y = _data()
    rng = np.random.default_rng(5)
    w0 = {"output.weight": rng.normal(size=(2, 3)), "output.bias": rng.normal(size=2)}
    theta0 = _lin(w0, 1.0, {k: rng.normal(size=v.shape) for k, v in w0.items()})
    memory0 = _lin(w0, 1.0, {k: rng.normal(size=v.shape) for k, v in w0.items()})
    finals = []
    for prior, moves_w in PRIORS:
        cfg = PFedBreDConfig(
            prior=prior, meta_step_updates_w=moves_w, local_steps=3, prox_steps=2, lam=4.0,
            lr=0.02, personal_lr=0.03, eta=0.3, eta_alpha=0.1,
        )  # fmt: skip
        finals.append(_reference(x, y, w0, theta0, memory0, cfg)[1]["output.weight"])
    for i in range(len(finals)):
        for j in range(i + 1, len(finals)):
            assert not np.allclose(finals[i], finals[j], rtol=1e-6), (PRIORS[i], PRIORS[j])


def test_pfedme_is_pfedbred_with_the_identity_prior_step_for_step() -> None:
    # Prepare: real minibatches (12 samples, batch 5) so batch order matters, stored state
    x, y = _data()
    common: dict[str, Any] = {
        "local_steps": 4,
        "prox_steps": 3,
        "batch_size": 5,
        "lam": 6.0,
        "lr": 0.02,
    }
    common["personal_lr"] = 0.01  # pFedMe's own default differs from pFedBreD's
    theta = {k: v + 0.5 for k, v in _context(PFedMeConfig(), x, y).global_shared.items()}
    state = {THETA + k: v for k, v in theta.items()} | {MEMORY + k: -v for k, v in theta.items()}
    runs = []
    for update, config in [
        (PFedMeUpdate(), PFedMeConfig(**common)),
        (PFedBreDUpdate(), PFedBreDConfig(prior="identity", **common)),
        (PFedBreDUpdate(), PFedBreDConfig(prior="meg", eta=0.0, **common)),
    ]:
        task = LeastSquares()
        ctx = _context(config, x, y, state=state, task=task)
        # Execute
        runs.append((update.run(ctx), task.calls))
    # Assert: the same parameters at every loss evaluation, the same delta and state
    (first, first_calls), *others = runs
    for result, calls in others:
        assert len(calls) == len(first_calls) == 4 * 3
        for call, expected in zip(calls, first_calls, strict=True):
            for name in NAMES:
                assert torch.equal(call[name][0], expected[name][0])
        for name in NAMES:
            assert torch.equal(result.shared_delta[name], first.shared_delta[name])
        assert result.state.keys() == first.state.keys()
        for key, value in result.state.items():
            assert torch.equal(value, first.state[key]), key


def test_mh_takes_two_minibatches_per_iteration_the_others_one() -> None:
    # Prepare: 7 gradient evaluations per iteration for mh (K + 2), K for pFedMe (spec §2.4)
    x, y = _data()
    counts = {}
    for prior in ("identity", "lg", "meg", "mh"):
        task = LeastSquares()
        ctx = _context(PFedBreDConfig(prior=prior, local_steps=2, prox_steps=5), x, y, task=task)
        # Execute
        PFedBreDUpdate().run(ctx)
        counts[prior] = len(task.calls)
    # Assert
    assert counts == {"identity": 10, "lg": 12, "meg": 10, "mh": 14}


def _personal_after(config, global_shift: float, state):
    x, y = _data()
    ctx = _context(config, x, y, state=state)
    with torch.no_grad():
        for parameter in ctx.model.parameters():
            parameter.add_(global_shift)
    ctx.global_shared = {k: v.detach().clone() for k, v in ctx.model.state_dict().items()}
    result = PFedBreDUpdate().run(ctx)
    theta = {n: result.state[THETA + n] for n in NAMES}
    return theta, ctx.global_shared


def _distance(a, b) -> float:
    return float(sum(((a[n] - b[n]) ** 2).sum() for n in NAMES) ** 0.5)


def test_small_lambda_ignores_the_global_model_and_large_lambda_tracks_it() -> None:
    # Prepare: theta warm-starts from its own previous value (prox_init), two different globals
    x, y = _data()
    ref = _context(PFedMeConfig(), x, y).global_shared
    state = {THETA + k: v + 1.0 for k, v in ref.items()} | {MEMORY + k: v for k, v in ref.items()}
    common: dict[str, Any] = {
        "local_steps": 5,
        "prox_steps": 5,
        "batch_size": 12,
        "prox_init": "prev_theta",
    }
    # Execute
    tiny = [
        _personal_after(PFedBreDConfig(lam=1e-9, **common), shift, state) for shift in (0.0, 3.0)
    ]
    big = [
        _personal_after(PFedBreDConfig(lam=90.0, **common), shift, state) for shift in (0.0, 3.0)
    ]
    # Assert: lam -> 0: theta is the same whatever the global model (up to lam-sized terms);
    # large lam: theta lands near each global model, far from the other
    assert _distance(tiny[0][0], tiny[1][0]) < 1e-6
    for theta, global_model in big:
        assert _distance(theta, global_model) < 0.1 * _distance(tiny[0][0], global_model)
    assert _distance(big[0][0], big[1][0]) > 4.0


def test_personalize_deploys_theta_not_w() -> None:
    # Prepare: a trained round, then a fresh context holding its state and the global model
    x, y = _data()
    first = _context(PFedBreDConfig(local_steps=2), x, y)
    result = PFedBreDUpdate().run(first)
    ctx = _context(PFedBreDConfig(local_steps=2), x, y, state=result.state)
    # Execute
    PFedBreDUpdate().personalize(ctx)
    # Assert
    for name, value in ctx.model.state_dict().items():
        assert torch.equal(value, result.state[THETA + name])
        assert not torch.equal(value, ctx.global_shared[name])


def test_personalize_without_state_keeps_the_received_model_and_ft_moves_theta() -> None:
    x, y = _data()
    ctx = _context(PFedBreDConfig(), x, y)
    PFedBreDUpdate().personalize(ctx)
    for name, value in ctx.model.state_dict().items():
        assert torch.equal(value, ctx.global_shared[name])
    tuned = _context(PFedBreDConfig(finetune_steps=1, batch_size=12, personal_lr=0.05), x, y)
    w0 = {k: v.numpy().copy() for k, v in tuned.global_shared.items()}
    PFedBreDUpdate().personalize(tuned)
    expected = _lin(w0, -0.05, _grad(x, y, w0))
    for name, value in tuned.model.state_dict().items():
        np.testing.assert_allclose(value.numpy(), expected[name], rtol=1e-9)
