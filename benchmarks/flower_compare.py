"""Side by side with Flower's simulation on one workload, in one run (optional).

Runs only where `flwr[simulation]` is installed; it is not a dependency of the project. Install it
into a virtual environment that sees the project, so the project's own environment stays as is:

    python -m venv --system-site-packages .venv-flower
    .venv-flower/bin/pip install -c constraints.txt "flwr[simulation]"
    .venv-flower/bin/python -m benchmarks.flower_compare [--repeats 2] [--out docs/benchmarks.md]

The workload is `simulation_overhead`'s (digits, 50 devices, FedAvg, 20 rounds, 1 local epoch):
the Flower client runs the same SGD loop on the same devices' data with the same model, the
server Flower's own FedAvg; both end with every device's test accuracy under the final model.
Flower runs on its Ray backend with one CPU per client (as many clients at once as cores);
`pfl-coord simulate` runs with its default workers (one per core) and with one.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import publish_section
from benchmarks.simulation_overhead import WORKLOAD, local_sgd, mean_test_metric
from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from pfl_tasks.base import DeviceData, Task
from pfl_tasks.registry import load_task

MARKER = "<!-- flower-compare -->"


@functools.cache
def _fleet() -> tuple[Task, list[DeviceData]]:
    """The workload's task and devices, built once per process (Flower's actors included)."""
    settings = SimulationSettings.load(None, **WORKLOAD)
    task = load_task(settings.task)
    return task, task.make_fleet(settings.devices, settings.partition_spec(), settings.seed)


def _set_weights(model: torch.nn.Module, weights: list[np.ndarray]) -> None:
    keys = list(model.state_dict())
    values = [torch.from_numpy(np.array(w)) for w in weights]
    model.load_state_dict(dict(zip(keys, values, strict=True)))


def _weights(model: torch.nn.Module) -> list[np.ndarray]:
    return [value.detach().numpy().copy() for value in model.state_dict().values()]


def _mean_accuracy(weights: list[np.ndarray]) -> float:
    task, fleet = _fleet()
    model = task.build_model(0)
    _set_weights(model, weights)
    return mean_test_metric(model, task, fleet)


def flower(repeat: int) -> tuple[float, float]:
    """FedAvg in Flower's simulation; (seconds, mean test accuracy of the final model)."""
    import flwr
    from flwr.client import ClientApp, NumPyClient
    from flwr.common import Context, ndarrays_to_parameters
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.simulation import run_simulation as run_flower

    settings = SimulationSettings.load(None, **WORKLOAD)
    config = settings.algorithm_config()

    class DigitsClient(NumPyClient):  # type: ignore[misc]
        def __init__(self, index: int) -> None:
            self.index = index

        def fit(self, parameters: list[np.ndarray], _: dict[str, Any]) -> Any:
            task, fleet = _fleet()
            data = fleet[self.index].train
            model = task.build_model(0)
            _set_weights(model, parameters)
            generator = torch.Generator().manual_seed(repeat * 100_000 + self.index)
            local_sgd(model, task, data, config, generator)
            return _weights(model), len(data), {}

    def client_fn(context: Context) -> Any:
        return DigitsClient(int(context.node_config["partition-id"])).to_client()

    final: list[float] = []

    def evaluate(server_round: int, weights: list[np.ndarray], _: dict[str, Any]) -> Any:
        if server_round == settings.rounds:
            final.append(_mean_accuracy(weights))
        return None

    def server_fn(_: Context) -> ServerAppComponents:
        task, _fleet_data = _fleet()
        strategy = FedAvg(
            fraction_fit=1.0,
            fraction_evaluate=0.0,
            min_fit_clients=settings.devices,
            min_available_clients=settings.devices,
            evaluate_fn=evaluate,
            initial_parameters=ndarrays_to_parameters(_weights(task.build_model(settings.seed))),
        )
        rounds = ServerConfig(num_rounds=settings.rounds)
        return ServerAppComponents(strategy=strategy, config=rounds)

    started = time.perf_counter()
    run_flower(
        server_app=ServerApp(server_fn=server_fn),
        client_app=ClientApp(client_fn=client_fn),
        num_supernodes=settings.devices,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    seconds = time.perf_counter() - started
    logging.getLogger(__name__).info("flwr %s: %.1f s", flwr.__version__, seconds)
    return seconds, final[-1] if final else float("nan")


def ours(workers: int) -> tuple[float, float]:
    """The same workload through `run_simulation`; (seconds, mean test accuracy)."""
    settings = SimulationSettings.load(None, **{**WORKLOAD, "workers": workers})
    started = time.perf_counter()
    result = run_simulation(settings)
    return time.perf_counter() - started, result.summary["metrics"]["personalized_mean"]


def main() -> None:
    """Run Flower and `simulate` alternately and write the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    args = parser.parse_args()
    try:
        import flwr
    except ImportError:
        msg = (
            'Flower is not installed here: pip install -c constraints.txt "flwr[simulation]" '
            "(see this module's docstring for a separate environment)"
        )
        raise SystemExit(msg) from None
    # Ray's workers unpickle the client by module name: the project's root must be importable
    # there, and the functions must come from the module, not from __main__
    root = str(Path(__file__).resolve().parent.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    from benchmarks import flower_compare as module

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    module.ours(0)  # warm-up: imports and the data set
    runs: dict[str, list[tuple[float, float]]] = {"flower": [], "ours": [], "ours1": []}
    for repeat in range(args.repeats):
        runs["flower"].append(module.flower(repeat))
        runs["ours"].append(module.ours(0))
        runs["ours1"].append(module.ours(1))
    seconds = {name: statistics.median(s for s, _ in values) for name, values in runs.items()}
    accuracy = {name: values[-1][1] for name, values in runs.items()}
    rows = [
        ("Flower simulation (Ray, 1 CPU per client)", "flower"),
        (f"`pfl-coord simulate` (default: {cores} workers)", "ours"),
        ("`pfl-coord simulate --workers 1`", "ours1"),
    ]
    publish_section(
        args.out,
        MARKER,
        [
            "## Side by side with Flower's simulation",
            "",
            "Workload: " + ", ".join(f"{k}={v}" for k, v in WORKLOAD.items()) + "; Flower's "
            "client runs the same SGD loop on the same devices' data; its server is Flower's "
            "FedAvg. Wall time of the whole run (Flower's includes starting Ray).",
            f"Machine: {platform.machine()}, {cores} cores; flwr {flwr.__version__}, "
            f"torch {torch.__version__}; median of {args.repeats} alternating repeats.",
            "",
            "| run | wall time (s) | Flower / this | mean test accuracy |",
            "|---|---:|---:|---:|",
            *(
                f"| {label} | {seconds[key]:.2f} | **{seconds['flower'] / seconds[key]:.1f}x** "
                f"| {accuracy[key]:.3f} |"
                for label, key in rows
            ),
            "",
            "Command (Flower is optional and not a dependency): see `benchmarks/flower_compare.py`"
            '\'s docstring; in short `pip install "flwr[simulation]"` into a separate virtual '
            "environment and run `python -m benchmarks.flower_compare` there. Target: 20x.",
        ],
    )


if __name__ == "__main__":
    main()
