"""Self-FL end to end on the gaussian task: run_simulation lands on the closed-form posterior."""

from typing import Any

import numpy as np
import pytest

from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from tests.wiretap import decoded_into

OBS_VAR = 0.1


def _gaussian(algorithm: str, **values: Any) -> SimulationSettings:
    """A run of `algorithm` on the gaussian task in one process."""
    return SimulationSettings.load(None, workers=1, task="gaussian", algorithm=algorithm, **values)


def _simulate(sigma0_sq: float, n_max: int, rounds: int, rho: float, **options: object):
    settings = _gaussian(
        "selffl",
        devices=20,
        rounds=rounds,
        seed=3,
        task_options={"sigma0_sq": sigma0_sq, "n_min": 10, "n_max": n_max, "obs_var": OBS_VAR},
        algorithm_options={
            "step_rule": "fixed_rho",
            "fixed_rho": rho,
            "lr": rho,  # full-batch GD on 0.5 mean((theta - y)^2) contracts by exactly lr
            "batch_size": 200,
            "l_max": 1000,
            "per_sample_variance": OBS_VAR,
            "sigma0_sq": sigma0_sq,
            **options,
        },
    )
    return run_simulation(settings)


def _iterate(z, sig, sigma0_sq, rho, rounds) -> tuple[np.ndarray, float, np.ndarray]:
    """Algorithm 1 with oracle variances, full participation, in closed form (spec §5.1)."""
    w = 1 / (sigma0_sq + sig)
    total = w.sum()
    s_minus = total - w
    steps = np.clip(np.floor(np.log1p(1 / (sig * s_minus)) / -np.log1p(-rho) + 0.5), 1, 1000)
    c = (1 - rho) ** steps
    glob, personal = 0.0, None
    for _ in range(rounds):
        start = (
            np.full_like(z, glob) if personal is None else glob - w / s_minus * (personal - glob)
        )
        personal = (1 - c) * z + c * start
        glob = (w * personal).sum() / total
    assert personal is not None
    return personal, glob, steps


@pytest.mark.timeout(1200)  # 200-round simulations: minutes on a loaded machine
@pytest.mark.parametrize(
    ("case", "sigma0_sq", "n_max", "rounds", "rho", "fl_tol", "g_tol"),
    [(1, 0.001, 20, 200, 0.005, 0.01, 0.01), (2, 1.0, 200, 15, 0.05, 0.002, 0.01)],
)
def test_selffl_converges_to_the_bayes_posterior(
    case, sigma0_sq, n_max, rounds, rho, fl_tol, g_tol
) -> None:
    # Execute
    result = _simulate(sigma0_sq, n_max, rounds, rho)
    # Prepare the oracle from the devices' own data (Eqs. 2-3 with sigma_m^2 = v^2/N_m)
    z = np.array([a.data.train.targets.double().mean().item() for a in result.agents])
    n = np.array([a.data.truth["num_observations"] for a in result.agents], dtype=float)
    assert np.array_equal(n, [len(a.data.train) for a in result.agents])
    sig = OBS_VAR / n
    w = 1 / (sigma0_sq + sig)
    s_minus = w.sum() - w
    fl = (z / sig + (w * z).sum() - w * z) / (1 / sig + s_minus)  # theta_m^(FL), Eq. 3
    g_bayes = (w * z).sum() / w.sum()  # theta^(G), Eq. 2
    personal = np.array([a.store._tensors["state:personal.theta"].item() for a in result.agents])
    glob = result.final_shared["theta"].item()
    # Assert: the simulation is the iteration, step for step (float32 on the devices) ...
    expected, expected_glob, steps = _iterate(z, sig, sigma0_sq, rho, rounds)
    assert personal == pytest.approx(expected, abs=2e-6)
    assert glob == pytest.approx(expected_glob, abs=2e-6)
    assert result.records[-1].scalars["local_steps_mean"] == pytest.approx(steps.mean())
    # ... it has converged, and lands on the Bayes targets within spec §7 oracle 4 / Prop. 3.1
    settled, _, _ = _iterate(z, sig, sigma0_sq, rho, 5000)
    assert np.abs(personal - settled).max() < 1e-4
    assert np.abs(personal - fl).mean() < fl_tol
    assert abs(glob - g_bayes) < g_tol
    # the personalized evaluation uses the personal model: its test MSE beats the global one's
    metrics = result.summary.metrics
    if case == 2:
        assert metrics["personalized_mean"] < metrics["global"]


def test_estimated_variances_and_client_sampling_run_clean() -> None:
    # No oracle: round-1 fallbacks, Eq. (13)/(14) estimates, C = 0.5 smoothing; no NaN (oracle 7)
    settings = _gaussian(
        "selffl-aug",
        devices=8,
        rounds=8,
        participation=0.5,
        seed=0,
        algorithm_options={"lr": 0.05, "batch_size": 50, "l_max": 40, "step_rule": "fixed_rho"},
    )
    result = run_simulation(settings)
    scalars = [r.scalars for r in result.records]
    assert scalars[0]["precision_weighted"] == 0.0
    assert any(s["precision_weighted"] == 1.0 for s in scalars)
    assert all(np.isfinite(v) for s in scalars for v in s.values())
    assert all(1 <= s["local_steps_mean"] <= 40 for s in scalars)
    assert np.isfinite(result.final_shared["theta"].item())


def test_the_fleet_scalars_reach_the_retained_fleet_status() -> None:
    # Prepare: a wiretap keeps the last retained fleet summary
    from coordinator.run.settings import SimulationSettings as Settings
    from coordinator.run.simulate import run_simulation as simulate
    from protocols.messages import FleetSummary
    from protocols.transport.inprocess import InProcessBroker

    broker = InProcessBroker()
    seen: list[FleetSummary] = []
    tap = broker.connect("wiretap")
    tap.subscribe("pfl/+/coordinator/fleet", decoded_into(FleetSummary, seen))
    # Execute
    result = simulate(
        Settings.load(None, workers=1, task="gaussian", algorithm="selffl", devices=6, rounds=3),
        broker=broker,
    )
    # Assert: what `pfl-coord status` shows is the last round's sigma_0^2, as in metrics.jsonl
    assert seen
    assert seen[-1].scalars.get("sigma0_sq") == result.records[-1].scalars.get("sigma0_sq")
    assert "sigma0_sq" in seen[-1].scalars
