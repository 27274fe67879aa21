"""Self-FL reproduction: the synthetic experiment of selffl.md §5.1 and a digits comparison."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import one_thread, write_section
from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from device_agent.state_store import MemoryStateStore, StateStore

MARKER = "<!-- selffl -->"
CASES = {1: (0.001, 10, 20), 2: (1.0, 10, 200)}  # sigma_0^2, N_min, N_max (selffl.md §5.1)
RATES = (0.1, 0.2, 0.5, 0.8, 1.0)
REFERENCE = {  # selffl.md §5.9: Self-FL global/local, FedAvg global/local, Self-FL mean l
    (1, 0.1): (0.486, 0.485, 0.035, 0.041, 4.0),
    (1, 0.2): (0.141, 0.141, 0.026, 0.040, 4.0),
    (1, 0.5): (0.017, 0.028, 0.020, 0.039, 4.0),
    (1, 0.8): (0.014, 0.027, 0.015, 0.038, 4.0),
    (1, 1.0): (0.016, 0.028, 0.015, 0.038, 4.0),
    (2, 0.1): (0.215, 0.037, 0.634, 0.074, 48.8),
    (2, 0.2): (0.209, 0.037, 0.426, 0.070, 49.0),
    (2, 0.5): (0.197, 0.037, 0.278, 0.070, 49.1),
    (2, 0.8): (0.187, 0.038, 0.208, 0.071, 48.7),
    (2, 1.0): (0.158, 0.038, 0.186, 0.069, 49.7),
}
INTRO = """## Self-FL: the paper's synthetic experiment, and digits

`python -m benchmarks.selffl_synthetic`. Closed-form shortcut of the experiment, {reps} repetitions,
T = 200, eta = 1e-4, theta^0 = 0, oracle variances, l = max(round(Eq. 16), 1), beta = C,
S_-m over all 19 others; FedAvg: 50 steps, sample weights, its local estimate the post-training
model; FedAvg+FT: 50 local steps from the final global; Ditto-style: 50 steps of
v <- v - eta (v - z)/sigma^2 - lambda (v - theta^(t-1)), best lambda of {{1e-3, 1e-2, 1e-1}}.
Errors are mean l1 against the true theta_0 / theta_m; "ref" are reference numbers computed
from the paper's setting (the paper gives figures only). "vs Bayes" is Self-FL's error
against theta_m^(FL) / theta^(G) (Eqs. 2-3).

What reproduced: every reference Self-FL and FedAvg number within Monte-Carlo noise (case 2 global
errors are dominated by sigma_0^2 = 1 and move by a few 0.01 between seeds), the mean step
count (4 in case 1, about 49 in case 2), the convergence to the Bayes targets at C >= 0.5
(case 1) and all C (case 2, local), and the reference finding that case 1 with beta = C has not
converged at C <= 0.2. What did not: the paper's claim "Self-FL best at small C" in case 1
(as the reference numbers already show); in case 2 the plain local estimate and the best
Ditto-style lambda have a lower local error against the *true* theta_m than Self-FL, because
Eq. (3) (client identifies its theta_m with theta_0) shrinks towards the others; Self-FL still
beats FedAvg, FedAvg+FT in both cases and is within 0.004 of its Bayes target.

"""
M, THETA_0, OBS_VAR, ETA, ROUNDS, BASE_STEPS = 20, 1.6, 0.1, 1e-4, 200, 50
UNGUARDED = {"norm_bound": 0.0, "max_count_ratio": 0.0, "max_weight_share": 1.0}
"""The aggregate guard's cuts off for the runs checked against the closed form, which has none
(with them, seed 0 clips a few devices' updates and agrees only to about 5e-3)."""


@dataclass(frozen=True)
class Fleet:
    """R repetitions of M devices: true theta_m, sample means z_m, sigma_m^2 = v^2/N_m."""

    theta: np.ndarray
    z: np.ndarray
    sig: np.ndarray
    sigma0_sq: float


def draw_fleets(case: int, reps: int, rng: np.random.Generator) -> Fleet:
    """selffl.md §5.1 generation; z_m ~ N(theta_m, v^2/N_m) is the sample mean's exact law."""
    sigma0_sq, lo, hi = CASES[case]
    theta = rng.normal(THETA_0, math.sqrt(sigma0_sq), size=(reps, M))
    n = rng.integers(lo, hi, endpoint=True, size=(reps, M))
    sig = OBS_VAR / n
    return Fleet(theta, rng.normal(theta, np.sqrt(sig)), sig, sigma0_sq)


def bayes_targets(f: Fleet) -> tuple[np.ndarray, np.ndarray]:
    """theta^(G) (Eq. 2) and theta_m^(FL) (Eq. 3) per repetition."""
    w = 1 / (f.sigma0_sq + f.sig)
    total = (w * f.z).sum(1, keepdims=True)
    s_minus = w.sum(1, keepdims=True) - w
    fl = (f.z / f.sig + total - w * f.z) / (1 / f.sig + s_minus)
    return total[:, 0] / w.sum(1), fl


def _active(rate: float, reps: int, rng: np.random.Generator) -> np.ndarray:
    k = max(math.floor(rate * M), 1)
    order = np.argsort(rng.random((reps, M)), axis=1)[:, :k]
    mask = np.zeros((reps, M), dtype=bool)
    np.put_along_axis(mask, order, True, axis=1)
    return mask


def selffl_closed_form(
    f: Fleet, rate: float, rho: np.ndarray, rng: np.random.Generator, beta: float | None = None
) -> tuple[np.ndarray, np.ndarray, float]:
    """Algorithm 1 with oracle variances, l GD steps in closed form (selffl.md §5.1 shortcut).

    rho is the per-step contraction eta_m/sigma_m^2; l = max(round(Eq. 16), 1), no l_max.
    """
    beta = rate if beta is None else beta
    w = 1 / (f.sigma0_sq + f.sig)
    s_minus = w.sum(1, keepdims=True) - w
    steps = np.maximum(np.floor(np.log1p(1 / (f.sig * s_minus)) / -np.log1p(-rho) + 0.5), 1)
    c = (1 - rho) ** steps
    glob = np.zeros(f.z.shape[0])
    personal = np.zeros_like(f.z)
    seen = np.zeros_like(f.z, dtype=bool)
    for _ in range(ROUNDS):
        active = _active(rate, f.z.shape[0], rng)
        g = glob[:, None]
        start = np.where(seen, g - w / s_minus * (personal - g), g)
        trained = (1 - c) * f.z + c * start
        personal = np.where(active, trained, personal)
        seen |= active
        mean = (w * personal * active).sum(1) / (w * active).sum(1)
        glob = (1 - beta) * glob + beta * mean
    return glob, np.where(seen, personal, glob[:, None]), float(steps.mean())


def _kept_tensors(store: StateStore) -> dict[str, torch.Tensor] | None:
    """What a simulated device keeps: its MemoryStateStore's own tensors, None if nothing yet."""
    assert isinstance(store, MemoryStateStore)
    return store._tensors


def baselines(f: Fleet, rate: float, rng: np.random.Generator) -> dict[str, tuple[Any, ...]]:
    """FedAvg (50 steps, sample weights), FedAvg+FT, Ditto-style (best lambda) and local."""
    c = (1 - ETA / f.sig) ** BASE_STEPS
    n = OBS_VAR / f.sig
    reps = f.z.shape[0]
    glob, last = np.zeros(reps), np.zeros_like(f.z)
    seen = np.zeros_like(f.z, dtype=bool)
    ditto_glob, ditto = {}, {}
    lambdas = (1e-3, 1e-2, 1e-1)
    personal = {lam: np.zeros_like(f.z) for lam in lambdas}
    for _ in range(ROUNDS):
        active = _active(rate, reps, rng)
        trained = (1 - c) * f.z + c * glob[:, None]
        last = np.where(active, trained, last)
        for lam in lambdas:  # v <- v - eta (v - z)/sigma^2 - lam (v - theta^{t-1}), 50 steps
            v = np.where(seen, personal[lam], glob[:, None])
            for _ in range(BASE_STEPS):
                v = v - ETA * (v - f.z) / f.sig - lam * (v - glob[:, None])
            personal[lam] = np.where(active, v, personal[lam])
        seen |= active
        glob = (n * trained * active).sum(1) / (n * active).sum(1)
    for lam in lambdas:
        ditto_glob[lam] = glob
        ditto[lam] = np.where(seen, personal[lam], glob[:, None])
    return {
        "fedavg": (glob, np.where(seen, last, glob[:, None])),
        "fedavg-ft": (glob, (1 - c) * f.z + c * glob[:, None]),
        **{f"ditto(lambda={lam:g})": (ditto_glob[lam], ditto[lam]) for lam in lambdas},
        "local": (None, f.z),
    }


def _errors(f: Fleet, glob: np.ndarray | None, local: np.ndarray) -> tuple[float, float]:
    g = float("nan") if glob is None else float(np.abs(glob - THETA_0).mean())
    return g, float(np.abs(local - f.theta).mean())


def closed_form_table(reps: int, seed: int) -> list[str]:
    """Mean l1 errors against the true theta_0 / theta_m, beside the §5.9 reference numbers."""
    rows = [
        "| case | C | Self-FL global | Self-FL local | ref | vs Bayes (local, global) | mean l "
        "| FedAvg global/local | ref | FedAvg+FT local | best Ditto local | local |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case in CASES:
        for rate in RATES:
            rng = np.random.default_rng([seed, case, int(rate * 10)])
            f = draw_fleets(case, reps, rng)
            g_bayes, fl = bayes_targets(f)
            glob, local, steps = selffl_closed_form(f, rate, ETA / f.sig, rng)
            sg, sl = _errors(f, glob, local)
            vs = (float(np.abs(local - fl).mean()), float(np.abs(glob - g_bayes).mean()))
            base = {k: _errors(f, *v) for k, v in baselines(f, rate, rng).items()}
            ditto = min((v[1], k) for k, v in base.items() if k.startswith("ditto"))
            ref = REFERENCE[(case, rate)]
            rows.append(
                f"| {case} | {rate} | {sg:.3f} | {sl:.3f} | {ref[0]:.3f}/{ref[1]:.3f} "
                f"| {vs[0]:.4f}, {vs[1]:.4f} | {steps:.1f} (ref {ref[4]}) "
                f"| {base['fedavg'][0]:.3f}/{base['fedavg'][1]:.3f} | {ref[2]:.3f}/{ref[3]:.3f} "
                f"| {base['fedavg-ft'][1]:.3f} | {ditto[0]:.3f} {ditto[1][5:]} "
                f"| {base['local'][1]:.3f} |"
            )
    return rows


def simulation_agreement(reps: int) -> list[str]:
    """Real run_simulation (oracle variances, fixed rho = lr, no guard) against the closed form."""
    rows = [
        "| case | C | seed | sim global/local error "
        "| max abs diff of personal models vs closed form, same data (C=1) | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for case, rho, rounds in ((1, 0.005, 200), (2, 0.05, 30)):
        sigma0_sq, lo, hi = CASES[case]
        for rate in (1.0, 0.5):
            for seed in range(reps):
                started = time.perf_counter()
                result = run_simulation(
                    SimulationSettings.load(
                        None,
                        workers=1,
                        task="gaussian",
                        algorithm="selffl",
                        devices=M,
                        rounds=rounds,
                        seed=seed,
                        participation=rate,
                        task_options={"sigma0_sq": sigma0_sq, "n_min": lo, "n_max": hi},
                        guard=UNGUARDED,
                        algorithm_options={
                            "step_rule": "fixed_rho",
                            "fixed_rho": rho,
                            "lr": rho,
                            "batch_size": 200,
                            "l_max": 10**6,
                            "smoothing_beta": rate,
                            "per_sample_variance": OBS_VAR,
                            "sigma0_sq": sigma0_sq,
                        },
                    )
                )
                agents = result.agents
                theta = np.array([[a.data.truth["theta"] for a in agents]])
                z = np.array([[a.data.train.targets.double().mean().item() for a in agents]])
                sig = OBS_VAR / np.array([[len(a.data.train) for a in agents]])
                f = Fleet(theta, z, sig, sigma0_sq)
                store = [_kept_tensors(a.store) for a in agents]
                glob = result.final_shared["theta"].item()
                personal = np.array(
                    [[s["state:personal.theta"].item() if s else glob for s in store]]
                )
                sg, sl = _errors(f, np.array([glob]), personal)
                diff = "-"
                if rate == 1.0:
                    ref = selffl_closed_form(f, 1.0, np.full_like(z, rho), np.random.default_rng(0))
                    diff = f"{np.abs(ref[1] - personal).max():.1e}"
                seconds = time.perf_counter() - started
                rows.append(
                    f"| {case} | {rate} | {seed} | {sg:.3f}/{sl:.3f} | {diff} | {seconds:.1f} |"
                )
    return rows


def digits_table(rounds: int) -> list[str]:
    """Self-FL against fedavg/fedavg-ft/local on digits, 20 devices, Dirichlet(0.3)."""
    rows = [
        "| algorithm | personalized mean | top-10% weighted | worst-10% | global | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for algorithm in ("selffl", "fedavg", "fedavg-ft", "local"):
        started = time.perf_counter()
        summary = run_simulation(
            SimulationSettings.load(
                None,
                workers=1,
                task="digits",
                algorithm=algorithm,
                devices=20,
                rounds=rounds,
                seed=0,
                partition="dirichlet",
                alpha=0.3,
            )
        ).summary
        m = summary["metrics"]
        values = [
            m[key]
            for key in (
                "personalized_mean",
                "personalized_top10_weighted",
                "personalized_worst10",
                "global",
            )
        ]
        cells = " | ".join("-" if v is None else f"{v:.3f}" for v in values)
        rows.append(f"| {algorithm} | {cells} | {time.perf_counter() - started:.0f} |")
    return rows


def main() -> None:
    """Run everything (a few minutes on one thread) and write docs/results.md's section."""
    one_thread()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    reps = int(os.environ.get("SELFFL_REPS", "200"))
    sections = {
        "closed": closed_form_table(reps, 0),
        "sim": simulation_agreement(int(os.environ.get("SELFFL_SIM_REPS", "2"))),
        "digits": digits_table(int(os.environ.get("SELFFL_DIGITS_ROUNDS", "30"))),
    }
    for rows in sections.values():
        print("\n".join(rows), "\n")
    write_section(
        Path(__file__).resolve().parents[1] / "docs" / "results.md",
        _section(sections, reps),
        MARKER,
    )


def _section(sections: dict[str, list[str]], reps: int) -> str:
    return "\n".join(
        [
            MARKER,
            INTRO.format(reps=reps),
            "\n".join(sections["closed"]),
            "",
            "### Through run_simulation (real devices, oracle variances)",
            "",
            "\n".join(sections["sim"]),
            "",
            "### digits, 20 devices, Dirichlet(0.3), default Self-FL settings",
            "",
            "\n".join(sections["digits"]),
            MARKER,
        ]
    )


if __name__ == "__main__":
    main()
