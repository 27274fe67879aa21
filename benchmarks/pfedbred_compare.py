"""Reproduce pFedBreD's ordering of prior strategies and baselines at small scale (issue 7).

pfedbred spec §4.9: no dataset of the paper can be downloaded here, so the comparison runs the
spec's sanity setting on the bundled `digits` (20 devices, 3 labels each, power-law sizes, 75/25)
and on `synthetic`: S = 4 of N = 20 per round, R = 20 local iterations, K = 5, batch 20,
alpha_m = alpha_p = 0.01, lam = 15, eta = 0.05, eta_alpha = 0.01, beta = 1, T = `--rounds` (60).
Only the sampled devices train (the official code trains all N and aggregates S, spec §6 A6;
`train_all_clients=True` does that, at 5x the cost), to stay within minutes on 2 CPUs. FedAvg
and Ditto's w take the same R = 20 minibatch steps at 0.01; FedAvg+FT fine-tunes 3 epochs at
0.02 before evaluation.

    OMP_NUM_THREADS=1 python -m benchmarks.pfedbred_compare [--seeds 3] [--rounds 60] [--jobs 2]

The table is written between the `<!-- pfedbred -->` markers of docs/results.md; `--quick` (one
seed, 10 rounds) prints without writing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from benchmarks.common import init_worker, mean_std_cell, write_section

MARKER = "<!-- pfedbred -->"
STEPS = {"local_epochs": 20, "max_steps": 20, "batch_size": 20, "lr": 0.01}
PAPER_STEPS: dict[str, Any] = {"lr": 0.01, "local_steps": 20, "personal_lr": 0.01}
LITERAL_MH: dict[str, Any] = {"prior": "mh_simple", "meta_step_updates_w": False}
ROWS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("pFedBreD mh (code, default)", "pfedbred", {"prior": "mh"}),
    (
        "pFedBreD mh (paper-literal)",
        "pfedbred",
        {"prior": "mh_simple", "meta_step_updates_w": False},
    ),
    ("pFedBreD meg", "pfedbred", {"prior": "meg"}),
    ("pFedBreD lg", "pfedbred", {"prior": "lg"}),
    ("pFedMe", "pfedme", PAPER_STEPS),  # pFedBreD's defaults; pFedMe's own are not the paper's
    ("Ditto (lam 1)", "ditto", {**STEPS, "personal_lr": 0.01}),
    ("FedAvg", "fedavg", STEPS),
    ("FedAvg+FT", "fedavg-ft", STEPS),
)
PAPER = {  # spec §4.4 Table 2 Avg (P, %) and §4.9 sanity run (digits MCLR seed 0, P / G)
    "pFedBreD mh (code, default)": ("81.5", "94.9 / 93.4"),
    "pFedBreD mh (paper-literal)": ("-", "92.3 / 91.2"),
    "pFedBreD meg": ("77.9", "92.3 / 91.4"),
    "pFedBreD lg": ("75.3", "92.5 / 91.4"),
    "pFedMe": ("77.6", "92.5 / 91.4"),
    "Ditto (lam 1)": ("-", "-"),
    "FedAvg": ("72.1 (G)", "- / 93.0"),
    "FedAvg+FT": ("-", "-"),
}


READINGS = """Readings of the 3-seed, T = 60 run of 2026-11-26 (what reproduced, what did not):

* **Reproduced on digits:** the reimplementation's finding. The code-version mh (the default) beats
  pFedMe on personalized accuracy (91.9 ± 1.1 vs 86.9 ± 1.9), and the paper-literal mh
  (Eq. 14, w not moved) does not (80.0 ± 5.9). meg and lg land near or slightly below pFedMe
  (84.5, 85.5), as in the paper's Table 2 ordering (mh > meg ≈ Non-PP, lg noisy). The earlier
  run of this table (91.8 ± 1.1 vs 87.0 ± 2.3) is not reproduced bit for bit, but every P lies
  within one std of it (largest moves: paper-literal mh on digits 80.9 -> 80.0, FedAvg on
  synthetic 75.8 -> 77.5).
* **pFedMe runs here at the paper's steps** (lr 0.01, R = 20, personal lr 0.01: pFedBreD's
  settings), not at pFedMe's own defaults, so the ordering above says nothing about pFedMe as
  it ships; the page docs/algorithms/pfedme.md gives that comparison.
* **Not separated on synthetic:** every personalized method lands at 82.8 to 84.3 with a std of
  about 2. The paper's ordering is neither confirmed nor contradicted there.
* **Baselines as strong as mh here:** Ditto (λ = 1) and FedAvg+FT reach mh's level on digits
  (90.6, 91.2). The paper (Table 8) has Ditto below mh. At this scale the gap to mh sits
  within a seed or two.
* **The G numbers do not match the reimplementation's:** its G is about 91–93; here pFedBreD's and
  pFedMe's global model reaches 34–52 % on digits, with large std. This run trains only the
  4 sampled devices per round with α_m = 0.01, so w is undertrained and each G depends on which
  devices were sampled last. The official code trains all 20 devices every round.
  `train_all_clients=True` does the same here at 5x the cost, and was not run in this budget.
* **Reporting:** P and G are final-round values, not the official code's best-over-rounds. The
  s/run column was measured on a shared, loaded machine (the whole run took 22 min; 4.4 min
  when it was quiet), so only its ratios mean anything."""


def run_one(
    task: str, algorithm: str, options: dict[str, Any], seed: int, rounds: int
) -> dict[str, Any]:
    """One simulation's final personalized and global accuracy (device means)."""
    from coordinator.run.compare import run_values
    from coordinator.run.settings import SimulationSettings
    from coordinator.run.simulate import run_simulation

    settings = SimulationSettings.load(
        None,
        task=task,
        algorithm=algorithm,
        devices=20,
        rounds=rounds,
        participation=0.2,
        partition="powerlaw",
        labels_per_device=3,
        seed=seed,
        algorithm_options=options,
    )
    started = time.perf_counter()
    values = run_values(run_simulation(settings).summary)
    return {
        "personalized": values["personalized_mean"],
        "global": values["global"] or values["personalized_mean"],
        "seconds": time.perf_counter() - started,
    }


def _cell(values: Sequence[float]) -> str:
    return mean_std_cell(values, scale=100, digits=1)


def render(
    results: dict[tuple[str, str], list[dict[str, Any]]], seeds: int, rounds: int, wall_s: float
) -> str:
    """The markdown section: one table per task, paper columns beside, then the readings."""
    lines = [
        MARKER,
        "## pFedBreD prior strategies vs. pFedMe, Ditto, FedAvg",
        "",
        f"`python -m benchmarks.pfedbred_compare`: a small sanity setting (T = {rounds}) with "
        "sampled-only training (the official code: all 20 devices train, 4 aggregated), "
        f"{seeds} seeds, final-round accuracy (%) as the unweighted mean over devices of each "
        "device's test accuracy (P = personal theta, G = the global model w). The paper column "
        "is Table 2's 8-setting average (P) and an independent reimplementation's MCLR digits "
        "run of the official setting (P / G).",
        "",
    ]
    for task in ("digits", "synthetic"):
        lines += [
            f"### {task}",
            "",
            "| algorithm | P (mean ± std) | G (mean ± std) | s/run | paper Avg P "
            "| reimplementation P / G |",
            "|---|---|---|---|---|---|",
        ]
        for label, _, _ in ROWS:
            runs = results[(task, label)]
            seconds = statistics.fmean(r["seconds"] for r in runs)
            lines.append(
                f"| {label} | {_cell([r['personalized'] for r in runs])} | "
                f"{_cell([r['global'] for r in runs])} | {seconds:.1f} | "
                f"{PAPER[label][0]} | {PAPER[label][1]} |"
            )
        lines.append("")
    lines += [f"Whole run: {wall_s / 60:.1f} min on 2 CPUs.", "", READINGS, MARKER]
    return "\n".join(lines)


def main() -> None:
    """Run every (task, row, seed) and write (or print) the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("docs/results.md"))
    args = parser.parse_args()
    seeds, rounds = (1, 10) if args.quick else (args.seeds, args.rounds)
    jobs = {
        (task, label, seed): (task, algorithm, options, seed, rounds)
        for task in ("digits", "synthetic")
        for label, algorithm, options in ROWS
        for seed in range(seeds)
    }
    started = time.perf_counter()
    with ProcessPoolExecutor(args.jobs, get_context("spawn"), init_worker) as pool:
        futures = {key: pool.submit(run_one, *job) for key, job in jobs.items()}
        results: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for (task, label, _), future in futures.items():
            results.setdefault((task, label), []).append(future.result())
    section = render(results, seeds, rounds, time.perf_counter() - started)
    print(section)
    if not args.quick:
        write_section(args.out, section, MARKER)


if __name__ == "__main__":
    main()
