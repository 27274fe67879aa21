"""Self-FL's device half: Eq. (8) steps, Eq. (10) start, the streaming variance, one round."""

import itertools
import math
from typing import Any

import numpy as np
import pytest
import torch

from device_agent.algorithms.base import LocalContext
from device_agent.algorithms.selffl import (
    MEAN,
    PERSONAL,
    STATS,
    RunningVariance,
    SelfFlAugUpdate,
    SelfFlUpdate,
    adjusted_init,
    init_push,
    load_history,
    step_count,
    update_running_variance,
)
from pfl_tasks.base import PartitionSpec
from pfl_tasks.gaussian import GaussianTask
from pfl_tasks.split import ParamSplit
from protocols.algorithms import SelfFlAugConfig, SelfFlConfig


def _batch_variance(xs: list[np.ndarray]) -> float:
    stacked = np.stack(xs)
    return float(((stacked - stacked.mean(axis=0)) ** 2).sum() / len(xs))


def test_streaming_variance_equals_the_batch_variance_of_the_history() -> None:
    # Prepare: 50 vectors over two tensors (dimension 7 in all), as spec §7 oracle 1
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=7) * (1 + i % 3) for i in range(50)]
    history = None
    # Execute / Assert at every length
    for t, x in enumerate(xs, start=1):
        sample = {"a": torch.tensor(x[:3]), "b": torch.tensor(x[3:]).reshape(2, 2)}
        history = update_running_variance(history, sample)
        assert history.count == t
        assert history.variance == pytest.approx(_batch_variance(xs[:t]), abs=1e-10)
        assert np.allclose(
            np.concatenate([history.mean["a"], history.mean["b"].reshape(-1)]),
            np.mean(xs[:t], axis=0),
        )


def test_printed_eq19_without_the_square_differs() -> None:
    # The literal Eq. (19) (middle term unsquared) is not the batch variance (spec §2.3, A15)
    rng = np.random.default_rng(1)
    xs = [rng.normal(size=7) for _ in range(50)]
    mean, s = np.zeros(7), 0.0
    for t, x in enumerate(xs, start=1):
        new = (t - 1) / t * mean + x / t
        s = (
            (t - 1) / t * s
            + (t - 1) / t * float((new - mean).sum())
            + float(((x - new) ** 2).sum()) / t
        )
        mean = new
    history: RunningVariance | None = None
    for x in xs:
        history = update_running_variance(history, {"x": torch.tensor(x)})
    assert history is not None
    assert history.variance == pytest.approx(_batch_variance(xs), abs=1e-10)
    assert abs(s - history.variance) > 1e-3


def test_forgetting_weights_old_samples_geometrically() -> None:
    # gamma < 1: the weighted variance with weights gamma^(t-i) (spec A19)
    xs = [np.array([v]) for v in (0.0, 1.0, 5.0, 2.0)]
    gamma = 0.5
    history: RunningVariance | None = None
    for x in xs:
        history = update_running_variance(history, {"x": torch.tensor(x)}, forgetting=gamma)
    assert history is not None
    weights = np.array([gamma**3, gamma**2, gamma, 1.0])
    values = np.array([x[0] for x in xs])
    mean = (weights * values).sum() / weights.sum()
    expected = (weights * (values - mean) ** 2).sum() / weights.sum()
    assert history.variance == pytest.approx(expected, rel=1e-12)
    assert history.weight == pytest.approx(weights.sum())


def _others(sigma0_sq: float, sigmas: list[float]) -> float:
    return sum(1 / (sigma0_sq + s) for s in sigmas)


def test_step_count_solves_eq8_and_clips() -> None:
    # Prepare: the spec's numeric example, synthetic case 1 (§1.4): l* from 3.72 to 4.02
    s_minus = _others(1e-3, [0.1 / 15] * 19)
    low = step_count(0.003, s_minus, 1e-4, rule="eq8")
    high = step_count(0.1, s_minus, 1e-4, rule="eq8")
    # Assert: rounded raw values, and (1 - eta/sigma^2)^l* = r exactly
    assert low[1] == pytest.approx(3.72, abs=0.01)
    assert high[1] == pytest.approx(4.02, abs=0.01)
    assert low[0] == high[0] == 4
    r = s_minus / (1 / 0.003 + s_minus)
    assert (1 - 1e-4 / 0.003) ** low[1] == pytest.approx(r, rel=1e-12)
    # alg2 divides rho by the batch size; fixed_rho uses kappa
    alg2 = step_count(0.003, s_minus, 1e-4, rule="alg2", batch_size=10)
    assert alg2[1] == pytest.approx(math.log(r) / math.log(1 - 1e-4 / (10 * 0.003)))
    fixed = step_count(0.003, s_minus, 1e-4, rule="fixed_rho", fixed_rho=0.05)
    assert fixed[1] == pytest.approx(math.log(r) / math.log(0.95))
    # clip to l_max and to at least 1
    assert step_count(0.003, s_minus, 1e-4, rule="alg2", batch_size=10, l_max=7)[0] == 7
    assert step_count(0.01, 1e-9, 1e-4, rule="fixed_rho", fixed_rho=0.9)[0] >= 1
    assert step_count(1.0, 1e6, 0.5, rule="fixed_rho", fixed_rho=0.9)[0] == 1


@pytest.mark.parametrize(
    ("sigma_m_sq", "s_minus", "lr", "extra", "expected"),
    [
        (0.01, 10.0, 0.02, {}, 40),  # rho = eta/sigma^2 >= 1: l_max
        (0.01, 10.0, 0.02, {"on_invalid_rate": "one"}, 1),  # ... or one step
        (0.0, 10.0, 1e-4, {}, 40),  # sigma^2 <= eps
        (0.01, 0.0, 1e-4, {}, 40),  # S_{-m} <= 0: client learns alone
        (0.01, math.inf, 1e-4, {}, 40),  # S_{-m} not finite
        (0.01, math.nan, 1e-4, {}, 20),  # NaN anywhere: l_default
        (math.nan, 10.0, 1e-4, {"rule": "fixed_rho"}, 20),  # NaN result: l_default
        (0.01, 10.0, 1e-4, {"rule": "fixed"}, 20),  # no adaptation
    ],
)
def test_step_count_edge_cases(sigma_m_sq, s_minus, lr, extra, expected) -> None:
    assert step_count(sigma_m_sq, s_minus, lr, l_max=40, l_default=20, **extra)[0] == expected


def test_step_count_is_monotone_and_bounded() -> None:
    # spec §7 oracle 3: non-decreasing in sigma_m^2 at fixed eta, below 1/(eta S_{-m})
    s_minus, eta = 50.0, 1e-4
    raws = [step_count(s, s_minus, eta, l_max=10**9)[1] for s in np.linspace(2e-4, 10, 200)]
    assert all(b >= a - 1e-12 for a, b in itertools.pairwise(raws))
    assert max(raws) < 1 / (eta * s_minus)


def test_eq6_eq7_eq8_reproduce_the_fl_posterior_and_eq9() -> None:
    # spec §7 oracle 2: continuous l* GD steps from init (7) land on theta_1^(FL) (Eq. 3)
    rng = np.random.default_rng(2)
    sigma0_sq, sig = 0.3, rng.uniform(0.01, 0.2, size=8)
    z = rng.normal(1.0, 1.0, size=8)
    w = 1 / (sigma0_sq + sig)
    s_minus = w.sum() - w[0]
    init7 = (w[1:] * z[1:]).sum() / s_minus
    eta = 0.5 * sig[0]
    _, raw = step_count(sig[0], s_minus, eta, l_max=10**9)
    c = (1 - eta / sig[0]) ** raw
    theta = (1 - c) * z[0] + c * init7
    fl = (z[0] / sig[0] + (w[1:] * z[1:]).sum()) / (1 / sig[0] + s_minus)
    assert theta == pytest.approx(fl, rel=1e-12)
    # Eq. (9): init (7) = theta^(G) - (w_1/S_{-1}) (theta_1^(L) - theta^(G)), via Eq. (10)'s code
    glob = (w * z).sum() / w.sum()
    push = init_push(sig[0], sigma0_sq, s_minus)
    assert push is not None
    start = adjusted_init({"t": torch.tensor(glob)}, {"t": torch.tensor(z[0])}, push)
    assert float(start["t"]) == pytest.approx(init7, rel=1e-12)


def test_init_push_guards() -> None:
    assert init_push(None, 1.0, 2.0) is None
    assert init_push(0.1, None, 2.0) is None
    assert init_push(0.0, 0.0, 2.0) is None  # w_m = 1/0
    assert init_push(0.1, 0.0, 0.0) is None  # S_{-m} = 0
    assert init_push(0.1, 0.3, 2.0) == pytest.approx(1 / (0.4 * 2.0))


def _gaussian_ctx(config: SelfFlConfig, state=None, assignment=None, global_theta=0.5):
    task = GaussianTask(sigma0_sq=1.0, n_min=30, n_max=30)
    data = task.make_fleet(1, PartitionSpec(), 0)[0]
    model = task.build_model(0)
    with torch.no_grad():
        model.get_parameter("theta").fill_(global_theta)
    return LocalContext(
        model=model,
        task=task,
        data=data,
        split=ParamSplit(shared=("theta",), personal=()),
        config=config,
        global_shared={"theta": torch.tensor([global_theta])},
        personal={},
        generator=torch.Generator().manual_seed(0),
        assignment=assignment or {},
        state=state or {},
    )


def _gd(theta: float, zbar: float, lr: float, steps: int) -> float:
    return zbar + (1 - lr) ** steps * (theta - zbar)


def test_first_activation_falls_back_and_keeps_its_state() -> None:
    # Prepare: no state, no downlink scalars (round 1): global start, l_default full-batch steps
    config = SelfFlConfig(lr=0.1, batch_size=30, l_default=7)
    ctx = _gaussian_ctx(config)
    zbar = float(ctx.data.train.targets.double().mean())
    # Execute
    result = SelfFlUpdate().run(ctx)
    # Assert
    expected = _gd(0.5, zbar, 0.1, 7)
    assert float(result.shared_delta["theta"]) == pytest.approx(expected - 0.5, abs=1e-6)
    assert result.scalars == {"local_steps": 7.0}  # sigma_m^2 undefined: not sent
    assert float(result.state[PERSONAL + "theta"]) == pytest.approx(expected, abs=1e-6)
    assert result.state[STATS].tolist()[:2] == [1.0, 1.0]
    assert result.personal == {}


def test_third_activation_uses_eq10_eq8_and_sends_the_pre_training_variance() -> None:
    # Prepare: two past personal models 0.9 and 1.3 (variance 0.04), global 0.5
    config = SelfFlConfig(lr=0.1, batch_size=30, step_rule="fixed_rho", fixed_rho=0.1)
    history = update_running_variance(None, {"theta": torch.tensor([0.9])})
    history = update_running_variance(history, {"theta": torch.tensor([1.3])})
    state = {
        PERSONAL + "theta": torch.tensor([1.3]),
        MEAN + "theta": history.mean["theta"],
        STATS: torch.tensor([2.0, 2.0, history.variance], dtype=torch.float64),
    }
    assignment = {"sigma0_sq": 0.06, "s_minus": 4.0}
    ctx = _gaussian_ctx(config, state, assignment)
    zbar = float(ctx.data.train.targets.double().mean())
    # Execute
    result = SelfFlUpdate().run(ctx)
    # Assert: by hand, sigma_m^2 = 0.04, w = 1/0.1 = 10, push = 10/4 = 2.5
    assert result.scalars["sigma_m_sq"] == pytest.approx(0.04)
    start = 0.5 - 2.5 * (1.3 - 0.5)
    steps = round(math.log(4.0 / (25.0 + 4.0)) / math.log(0.9))
    assert result.scalars["local_steps"] == steps == 19
    expected = _gd(start, zbar, 0.1, steps)
    assert float(result.shared_delta["theta"]) == pytest.approx(expected - 0.5, abs=1e-5)
    after = load_history(result.state, ("theta",))
    assert after is not None
    assert after.count == 3
    assert after.variance == pytest.approx(
        _batch_variance([np.array([0.9]), np.array([1.3]), np.array([expected])]), abs=1e-6
    )


@pytest.mark.parametrize("toggle", ["adjust_init", "adaptive_steps"])
def test_ablation_toggles(toggle: str) -> None:
    switched_off: dict[str, Any] = {toggle: False}
    config = SelfFlConfig(
        lr=0.1,
        batch_size=30,
        l_default=3,
        step_rule="fixed_rho",
        fixed_rho=0.1,
        per_sample_variance=0.1,
        **switched_off,
    )
    state = {PERSONAL + "theta": torch.tensor([1.3])}
    ctx = _gaussian_ctx(config, state, {"sigma0_sq": 0.06, "s_minus": 4.0})
    result = SelfFlUpdate().run(ctx)
    zbar = float(ctx.data.train.targets.double().mean())
    sig = 0.1 / 30
    push = 1 / ((0.06 + sig) * 4.0)
    start = 0.5 if toggle == "adjust_init" else 0.5 - push * (1.3 - 0.5)
    steps = (
        3
        if toggle == "adaptive_steps"
        else step_count(sig, 4.0, 0.1, rule="fixed_rho", fixed_rho=0.1)[0]
    )
    assert result.scalars["local_steps"] == steps
    assert result.scalars["sigma_m_sq"] == pytest.approx(sig)  # oracle v^2/N_m
    expected = _gd(start, zbar, 0.1, steps)
    assert float(result.shared_delta["theta"]) == pytest.approx(expected - 0.5, abs=1e-5)


def test_personalize_loads_the_personal_model_or_keeps_the_global() -> None:
    config = SelfFlConfig()
    ctx = _gaussian_ctx(config, {PERSONAL + "theta": torch.tensor([1.25])})
    SelfFlUpdate().personalize(ctx)
    assert float(ctx.model.theta.detach()) == 1.25
    fresh = _gaussian_ctx(config)
    SelfFlUpdate().personalize(fresh)
    assert float(fresh.model.theta.detach()) == 0.5


def test_augmented_uploads_the_local_optimum_and_keeps_the_personal_model() -> None:
    # Prepare: full batch, lr 0.5: the optimum is (nearly) the sample mean
    config = SelfFlAugConfig(lr=0.5, batch_size=30, l_default=2, conv_max_epochs=40, conv_tol=0)
    ctx = _gaussian_ctx(config)
    zbar = float(ctx.data.train.targets.double().mean())
    # Execute
    result = SelfFlAugUpdate().run(ctx)
    # Assert: personal model after l_default steps; optimum sent and anchored
    personal = _gd(0.5, zbar, 0.5, 2)
    assert float(result.state[PERSONAL + "theta"]) == pytest.approx(personal, abs=1e-6)
    assert float(result.state["anchor.theta"]) == pytest.approx(zbar, abs=1e-5)
    assert float(result.shared_delta["theta"]) == pytest.approx(zbar - 0.5, abs=1e-5)
    assert float(ctx.model.theta.detach()) == pytest.approx(personal, abs=1e-6)
