"""Every algorithm on every built-in task, with few and with many samples per device.

docs/results.md opens with this matrix. Each built-in task runs in two settings, because which
method wins depends on how much data a device holds:

* few:  100 devices with power-law (or, where the task fixes sizes, small) local data sets;
* many: 20 devices with plenty of samples each.

Every algorithm of the registry runs on every workload for several seeds through the compare
machinery (`coordinator.run.compare.plan_runs` / `run_comparison`), and each finished cell (task,
setting, algorithm, seed) is cached as JSON under benchmarks/results/. A rerun computes only
the missing cells (a new algorithm, a new seed), and `--from-cache` rewrites the doc section and
the plots (docs/img/results-<task>-<setting>-{accuracy,gain}.png) without simulating. Each cell
records the aggregate guard's bounds it ran under: a rerun recomputes cells run under other
bounds (a changed default), and the doc marks them until then.

    OMP_NUM_THREADS=1 nice -n 5 python -m benchmarks.results_matrix [--seeds 3]
        [--tasks digits,sine] [--settings few] [--algorithms fedavg,ditto] [--from-cache]

An algorithm that cannot run on a workload (FedAlt/FedSim on a model whose output preset leaves
nothing shared) gets an "n/a" row with the reason instead of failing the matrix.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from benchmarks.common import choose, write_section
from coordinator.ops.report import RunData, load_run, plot_accuracy, plot_gain_vs_samples
from coordinator.run.compare import (
    COLUMNS,
    RunOutcome,
    RunSpec,
    aggregate,
    format_cells,
    parse_seeds,
    plan_runs,
    run_comparison,
    run_values,
)
from pfl_tasks.presets import resolve_preset
from pfl_tasks.registry import load_task
from pfl_tasks.split import ParamSplit
from protocols.algorithms import algorithm_names

logger = logging.getLogger(__name__)

REPO: Final = Path(__file__).resolve().parents[1]
MARKER: Final = "<!-- results-matrix -->"
CACHE_VERSION: Final = 2
ALGORITHMS: Final = (
    "local", "fedavg", "fedavg-ft", "fedprox", "fedsim", "fedalt",
    "selffl", "pfedbred", "pfedme", "ditto", "federico",
)  # fmt: skip
PARTIAL: Final = ("fedalt", "fedsim")  # FedPer-style: shared body, personal output layer
PROXIMAL: Final = ("pfedme", "pfedbred")  # their own step sizes and R local iterations
SETTINGS: Final = ("few", "many")
STALE: Final = (
    "measured under other aggregate guard bounds than today's defaults (the cache files hold "
    "no or another `guard`); a rerun of this table recomputes them"
)
# The table's columns, a subset of compare's COLUMNS, in this order.
TABLE_KEYS: Final = (
    "personalized_mean", "personalized_worst10", "global", "helped", "hurt",
    "bytes_up_per_round", "wall_seconds",
)  # fmt: skip
TRAIN: Final = {"rounds": 30, "local_epochs": 2, "lr": 0.1, "batch_size": 10}
# pFedMe/pFedBreD: K = 5 prox steps, batch 20 (paper); R = 10 and alpha_p = 0.1 (paper: 20 and
# 0.01, which leave both far from converged in 30 rounds); alpha_m = 0.05.
PROX: Final = {"local_steps": 10, "prox_steps": 5, "personal_lr": 0.1, "lr": 0.05}


@dataclass(frozen=True)
class Workload:
    """One task in one setting: simulate's settings and the proximal methods' options."""

    task: str
    setting: str
    title: str
    simulate: dict[str, Any]
    proximal: dict[str, Any] = field(default_factory=lambda: dict(PROX))

    @property
    def key(self) -> str:
        """`<task>-<setting>`: the cache folder and the plot names."""
        return f"{self.task}-{self.setting}"

    def overrides(self, algorithm: str) -> dict[str, Any]:
        """Simulate's settings for `algorithm` on this workload.

        FedAlt/FedSim run the partial-personalization pipeline in the same total rounds (half
        FedAvg pretraining, half the algorithm) with the output preset; pFedMe/pFedBreD take their
        step sizes and iteration counts from `proximal` instead of the common flags.
        """
        values = {**self.simulate, "task": self.task}
        if algorithm in PARTIAL:
            half = values["rounds"] // 2
            values.update(rounds=values["rounds"] - half, pretrain_rounds=half)
            values["personal_preset"] = "output"
        if algorithm in PROXIMAL:
            for key in ("local_epochs", "lr", "batch_size"):
                values.pop(key, None)
            values["algorithm_options"] = dict(self.proximal)
        return values


def _workload(task: str, setting: str, title: str, **simulate: Any) -> Workload:
    proximal = simulate.pop("proximal", {})
    return Workload(task, setting, title, {**TRAIN, **simulate}, {**PROX, **proximal})


SCALAR_LAM: Final = {"lam": 1.0}  # Ditto's lambda; lam 15 with alpha_p 0.1 oscillates on these
# A prox step is stable while alpha_p (L + lam) < 2: Synthetic(1, 1)'s 60 features of unit scale
# put its curvature L past 5, and at alpha_p 0.1 with lam 15 pFedBreD's theta diverged on some
# devices (its prox loss 2.3 -> 1e11 over 30 rounds, seed 0 many; their updates clipped by the
# guard); at 0.05 it stays bounded. pFedMe shares the setting to stay comparable.
STIFF_PROX: Final = {"personal_lr": 0.05}
WORKLOADS: Final = (
    _workload("digits", "few", "100 devices, power-law sizes, 2 labels each (pFedMe's MNIST "
              "generator)", devices=100, partition="powerlaw", labels_per_device=2),
    _workload("digits", "many", "20 devices, Dirichlet(0.3) label skew, ~60 training samples "
              "each", devices=20, partition="dirichlet", alpha=0.3),
    _workload("synthetic", "few", "100 devices, Synthetic(1, 1), power-law sizes capped at 200",
              devices=100, task_options={"max_samples": 200}, proximal=STIFF_PROX),
    _workload("synthetic", "many", "20 devices, Synthetic(1, 1), power-law sizes up to 1000",
              devices=20, proximal=STIFF_PROX),
    _workload("gaussian", "few", "100 devices, 2-20 observations each (sigma_0^2 = 1)",
              devices=100, task_options={"n_min": 2, "n_max": 20}, proximal=SCALAR_LAM),
    _workload("gaussian", "many", "20 devices, 10-200 observations each (Self-FL case 2)",
              devices=20, proximal=SCALAR_LAM),
    _workload("sine", "few", "100 devices, 5 training points each, 4 intervals",
              devices=100, task_options={"n_train": 5}, local_epochs=5, proximal=SCALAR_LAM),
    _workload("sine", "many", "20 devices, 50 training points each, 4 intervals",
              devices=20, task_options={"n_train": 50}, local_epochs=5, proximal=SCALAR_LAM),
)  # fmt: skip


@dataclass
class Cell:
    """One cached run: its planned spec and what it recorded."""

    spec: RunSpec
    summary: dict[str, Any]
    rounds: list[dict[str, Any]]
    devices: list[dict[str, Any]]
    guard: dict[str, Any] | None = None
    """The aggregate guard's bounds it ran under (None: recorded before cells kept them)."""

    @property
    def current(self) -> bool:
        """Whether it ran under today's guard bounds (a stale cell is rerun, shown as stale)."""
        return self.guard == guard_fingerprint(self.spec)


@dataclass
class MatrixRun:
    """What one invocation computed and reused."""

    computed: int = 0
    reused: int = 0
    seconds: float = 0.0


def cell_path(cache_dir: Path, workload: Workload, algorithm: str, seed: int) -> Path:
    """Where cell (task, setting, algorithm, seed) is cached."""
    return cache_dir / workload.key / algorithm / f"seed-{seed}.json"


def cell_request(workload: Workload, algorithm: str, seed: int) -> dict[str, Any]:
    """What defines a cell: the settings the matrix asks simulate for, as JSON values.

    Only the requested values count, not every default of `SimulationSettings`, so a setting
    added to the program later does not invalidate the cache; changing a workload does.
    """
    request = {**workload.overrides(algorithm), "algorithm": algorithm, "seed": seed}
    normalized: dict[str, Any] = json.loads(json.dumps(request, sort_keys=True))
    return normalized


def not_applicable(workload: Workload, algorithm: str) -> str | None:
    """Why `algorithm` cannot run on `workload`, or None when it can."""
    if algorithm not in algorithm_names():
        return "not in this build yet (protocols.algorithms does not list it)"
    if algorithm in PARTIAL:
        model = load_task(workload.task, workload.simulate.get("task_options")).build_model(0)
        split = ParamSplit.for_model(model, resolve_preset("output", model))
        if not split.shared or not split.personal:
            return (
                f"the output preset makes every tensor of the {workload.task} model personal "
                f"({', '.join(split.personal)}): nothing is left to share"
            )
    try:
        plan_runs([algorithm], [0], Path("."), overrides=workload.overrides(algorithm))
    except ValueError as error:
        return str(error)
    return None


def guard_fingerprint(spec: RunSpec) -> dict[str, Any]:
    """The aggregate guard's bounds in effect for `spec`, as JSON values.

    The request holds only what the matrix asks for, so a changed guard default would otherwise
    reuse cells measured under the old bounds: a cell records them, reused only while they match.
    """
    bounds: dict[str, Any] = json.loads(json.dumps(asdict(spec.settings.guard_settings())))
    return bounds


def load_cell(path: Path, spec: RunSpec, request: dict[str, Any]) -> Cell | None:
    """The cached cell at `path` if it was run with `request` (under any guard), else None."""
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if data.get("version") != CACHE_VERSION or data.get("request") != request:
        logger.warning("%s was run with other settings; it will be recomputed", path)
        return None
    return Cell(spec, data["summary"], data["rounds"], data["devices"], data.get("guard"))


def run_cell(path: Path, spec: RunSpec, request: dict[str, Any]) -> Cell:
    """Simulate one cell through compare's runner, then cache its summary, rounds and devices."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / spec.algorithm / f"seed-{spec.seed}"
        local = RunSpec(spec.algorithm, spec.seed, spec.settings.model_copy(update={"out": out}))
        run_comparison([local], Path(tmp))
        run = load_run(out)
    cell = Cell(spec, run.summary, run.rounds, run.devices, guard_fingerprint(spec))
    document = {
        "version": CACHE_VERSION,
        "request": request,
        "guard": cell.guard,
        "settings": spec.settings.model_dump(mode="json", exclude={"out"}),
        "summary": cell.summary,
        "rounds": cell.rounds,
        "devices": cell.devices,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, sort_keys=True))
    return cell


def compute(
    workloads: Sequence[Workload],
    algorithms: Sequence[str],
    seeds: Sequence[int],
    cache_dir: Path,
) -> MatrixRun:
    """Run every missing applicable cell, one simulation at a time."""
    progress = MatrixRun()
    started = time.perf_counter()
    for workload in workloads:
        for algorithm in algorithms:
            if not_applicable(workload, algorithm) is not None:
                continue
            specs = plan_runs(
                [algorithm], list(seeds), Path("."), overrides=workload.overrides(algorithm)
            )
            for spec in specs:
                path = cell_path(cache_dir, workload, algorithm, spec.seed)
                request = cell_request(workload, algorithm, spec.seed)
                cached = load_cell(path, spec, request)
                if cached is not None and cached.current:
                    progress.reused += 1
                    continue
                if cached is not None:
                    logger.warning("%s ran under other guard bounds; it will be recomputed", path)
                cell = run_cell(path, spec, request)
                progress.computed += 1
                logger.info(
                    "%s %s seed %d: %s in %.1f s",
                    workload.key, algorithm, spec.seed,
                    cell.summary["metrics"]["personalized_mean"], cell.summary["wall_seconds"],
                )  # fmt: skip
    progress.seconds = time.perf_counter() - started
    return progress


def cached_cells(workload: Workload, algorithm: str, cache_dir: Path) -> list[Cell]:
    """Every cached seed of one workload and algorithm run with today's request (any guard)."""
    folder = cache_dir / workload.key / algorithm
    seeds = sorted(int(p.stem.removeprefix("seed-")) for p in folder.glob("seed-*.json"))
    if not seeds:
        return []
    specs = plan_runs([algorithm], seeds, Path("."), overrides=workload.overrides(algorithm))
    loaded = (
        load_cell(
            cell_path(cache_dir, workload, algorithm, s.seed),
            s,
            cell_request(workload, algorithm, s.seed),
        )
        for s in specs
    )
    return [cell for cell in loaded if cell is not None]


def _settings_line(workload: Workload) -> str:
    values = workload.simulate
    parts = [f"{key} {values[key]}" for key in ("devices", "rounds", "local_epochs", "lr")]
    parts += [
        f"{k} {values[k]}" for k in ("partition", "alpha", "labels_per_device") if k in values
    ]
    if values.get("task_options"):
        parts.append(f"task options {json.dumps(values['task_options'])}")
    proximal = ", ".join(f"{k} {v}" for k, v in workload.proximal.items())
    return (
        f"Settings: {', '.join(parts)}, batch {values['batch_size']}; fedalt/fedsim: "
        f"{values['rounds'] // 2} FedAvg rounds then {values['rounds'] - values['rounds'] // 2} "
        f"with the output preset; pfedme/pfedbred: {proximal}."
    )


def render_table(workload: Workload, algorithms: Sequence[str], cache_dir: Path) -> list[str]:
    """One workload's markdown: settings, command, table (mean ± std over seeds), ranking."""
    index = {key: i for i, (key, _, _) in enumerate(COLUMNS)}
    headers = [header for key, header, _ in COLUMNS if key in TABLE_KEYS]
    rows, scores, metric = [], {}, "accuracy"
    notes: dict[str, list[str]] = {}
    for algorithm in algorithms:
        reason = not_applicable(workload, algorithm)
        cells = [] if reason else cached_cells(workload, algorithm, cache_dir)
        if not cells:
            status = "n/a" if reason else "not run yet"
            rows.append(f"| {algorithm} | 0 | {status}" + " |" * len(headers))
            if reason:
                notes.setdefault(f"n/a, {reason}", []).append(algorithm)
            continue
        if not all(cell.current for cell in cells):
            notes.setdefault(STALE, []).append(algorithm)
        metric = cells[0].summary.get("metric_name", metric)
        (row,) = aggregate([RunOutcome(c.spec, c.summary, run_values(c.summary)) for c in cells])
        text = format_cells(row)
        cells_text = " | ".join(text[index[key]] for key in TABLE_KEYS)
        rows.append(f"| {algorithm} | {row.runs} | {cells_text} |")
        if row.mean["personalized_mean"] is not None:
            scores[algorithm] = row.mean["personalized_mean"]
        else:
            failed = sum(1 for c in cells if c.summary["metrics"]["personalized_mean"] is None)
            reason = (
                f"{failed} of {row.runs} runs ended with no device score (every evaluation failed)"
            )
            notes.setdefault(reason, []).append(algorithm)
    lines = [
        f"### {workload.task}, {workload.setting}: {workload.title}",
        "",
        _settings_line(workload),
        f"Metric: {metric} on each device's own test split, mean over devices (worst 10%: mean "
        "of the worst tenth of devices). Command: `OMP_NUM_THREADS=1 python -m "
        f"benchmarks.results_matrix --tasks {workload.task} --settings {workload.setting}`",
        "",
        "| algorithm | seeds | " + " | ".join(headers) + " |",
        "|---|---:|" + "---:|" * len(headers),
        *rows,
    ]
    if scores:
        order = sorted(scores, key=scores.__getitem__, reverse=metric == "accuracy")
        ranking = ", ".join(f"{name} {scores[name]:.3f}" for name in order)
        better = "higher" if metric == "accuracy" else "lower"
        lines += ["", f"Ranking by personalized mean ({better} is better): {ranking}."]
    lines += [""] if notes else []
    return lines + [f"- {', '.join(names)}: {reason}" for reason, names in notes.items()]


def write_plots(
    workload: Workload, algorithms: Sequence[str], cache_dir: Path, img_dir: Path
) -> list[Path]:
    """The accuracy-per-round and per-device gain plots of one workload, from the cache."""
    grouped: dict[str, list[RunData]] = {}
    for algorithm in algorithms:
        for cell in cached_cells(workload, algorithm, cache_dir):
            run = RunData(
                cell_path(cache_dir, workload, algorithm, cell.spec.seed),
                algorithm, cell.rounds, cell.devices, cell.summary,
            )  # fmt: skip
            grouped.setdefault(algorithm, []).append(run)
    if not grouped:
        return []
    img_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, plot in (("accuracy", plot_accuracy), ("gain", plot_gain_vs_samples)):
        path = img_dir / f"results-{workload.key}-{name}.png"
        if plot(grouped, path):
            written.append(path)
    return written


def render_section(
    workloads: Sequence[Workload],
    algorithms: Sequence[str],
    cache_dir: Path,
    img_dir: Path,
    doc: Path,
) -> str:
    """The doc's matrix section, with every workload's table and plots, from the cache only."""
    lines = [
        MARKER,
        "<!-- written by benchmarks/results_matrix.py from benchmarks/results/; do not edit -->",
    ]
    total = 0.0
    for workload in workloads:
        lines += ["", *render_table(workload, algorithms, cache_dir)]
        total += sum(
            c.summary["wall_seconds"]
            for a in algorithms
            for c in cached_cells(workload, a, cache_dir)
        )
        plots = write_plots(workload, algorithms, cache_dir, img_dir)
        if plots:
            lines.append("")
            for path in plots:
                label = path.stem.rsplit("-", 1)[-1]
                lines.append(f"![{workload.key} {label}]({_relative(path, doc.parent)})")
    lines += ["", f"Sum of the cached runs' wall time: {total / 60:.1f} minutes.", MARKER]
    return "\n".join(lines)


def _relative(path: Path, start: Path) -> str:
    try:
        return path.resolve().relative_to(start.resolve()).as_posix()
    except ValueError:
        return path.as_posix()


def matrix_algorithms() -> list[str]:
    """ALGORITHMS, plus any algorithm the registry gained since (except selffl-aug's variant)."""
    extra = [a for a in algorithm_names() if a not in ALGORITHMS and a != "selffl-aug"]
    return [*ALGORITHMS, *extra]


@dataclass(frozen=True)
class Output:
    """Where the section goes and what it shows (the whole matrix, whatever was computed)."""

    doc: Path
    img_dir: Path
    workloads: Sequence[Workload]
    algorithms: Sequence[str]


def run_matrix(
    workloads: Sequence[Workload],
    algorithms: Sequence[str],
    seeds: Sequence[int],
    cache_dir: Path,
    output: Output,
    *,
    from_cache: bool = False,
) -> MatrixRun:
    """Compute the missing cells of `workloads` (unless `from_cache`), then rewrite the section."""
    progress = MatrixRun() if from_cache else compute(workloads, algorithms, seeds, cache_dir)
    logger.info(
        "computed %d cells, reused %d, in %.1f minutes",
        progress.computed, progress.reused, progress.seconds / 60,
    )  # fmt: skip
    section = render_section(
        output.workloads, output.algorithms, cache_dir, output.img_dir, output.doc
    )
    write_section(output.doc, section, MARKER)
    logger.info("wrote %s", output.doc)
    return progress


def main(argv: Sequence[str] | None = None) -> None:
    """Compute the missing cells of the selected part, then rewrite the whole section."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", help="comma-separated (default: every built-in task)")
    parser.add_argument("--settings", help="few, many or both (default: both)")
    parser.add_argument("--algorithms", help="comma-separated (default: every algorithm)")
    parser.add_argument("--seeds", default="3", help="a count N (0..N-1) or a list like 0,1,2")
    parser.add_argument("--from-cache", action="store_true", help="write the doc, run nothing")
    parser.add_argument("--cache-dir", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--doc", type=Path, default=REPO / "docs" / "results.md")
    parser.add_argument("--img-dir", type=Path, default=REPO / "docs" / "img")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("coordinator", "device_agent", "protocols"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    algorithms = matrix_algorithms()
    tasks = choose(args.tasks, sorted({w.task for w in WORKLOADS}), "task")
    settings = choose(args.settings, SETTINGS, "setting")
    selected = [w for w in WORKLOADS if w.task in tasks and w.setting in settings]
    run_matrix(
        selected,
        choose(args.algorithms, algorithms, "algorithm"),
        parse_seeds(args.seeds),
        args.cache_dir,
        Output(args.doc, args.img_dir, WORKLOADS, algorithms),
        from_cache=args.from_cache,
    )


if __name__ == "__main__":
    main()
