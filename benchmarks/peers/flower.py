"""The workload in Flower's simulation: Flower's FedAvg, each client running `common.local_sgd`.

Flower runs its clients on its Ray backend with one CPU each (as many at once as cores); its
server is Flower's own FedAvg (sample-weighted mean of the returned weights). The clock starts
when the strategy configures round 1 and stops when it has aggregated the last round.

    python -m benchmarks.peers.flower --workload DIR --result FILE
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.peers import common


def set_weights(model: torch.nn.Module, weights: list[np.ndarray]) -> None:
    """Load Flower's list of arrays (state_dict order) into `model`."""
    values = [torch.from_numpy(np.array(w)) for w in weights]
    model.load_state_dict(dict(zip(model.state_dict(), values, strict=True)))


def weights_of(model: torch.nn.Module) -> list[np.ndarray]:
    """`model`'s state as Flower's list of arrays."""
    return [value.detach().numpy().copy() for value in model.state_dict().values()]


@functools.cache
def actor_workload(directory: Path, threads: int) -> common.Workload:
    """The workload in a Ray actor, read (and torch warmed up) once per actor process.

    Module-level, so it outlives the client objects Flower makes for every fit; a cache in the
    client's closure would be unpickled anew with each task and re-read the files every time.
    """
    torch.set_num_threads(threads)
    return common.ready_workload(directory)


def client_factory(directory: Path, threads: int) -> Callable[[Any], Any]:
    """Flower's `client_fn`: a client that trains device `partition-id`."""
    from flwr.client import NumPyClient

    class DeviceClient(NumPyClient):  # type: ignore[misc]
        def __init__(self, device: int) -> None:
            self.device = device

        def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> Any:
            workload = actor_workload(directory, threads)
            model = workload.build_model()
            set_weights(model, parameters)
            common.local_sgd(model, workload, self.device, int(config["round"]) - 1)
            return weights_of(model), len(workload.devices[self.device].train_y), {}

    def client_fn(context: Any) -> Any:
        return DeviceClient(int(context.node_config["partition-id"])).to_client()

    return client_fn


def main() -> None:
    """Run the workload in Flower's simulation and write the result."""
    from flwr.client import ClientApp
    from flwr.common import Context, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.simulation import run_simulation

    arguments, workload = common.start_run(__doc__ or "")
    devices = len(workload.devices)
    clock = common.RoundClock()
    final: list[list[np.ndarray]] = []

    class TimedFedAvg(FedAvg):  # type: ignore[misc]
        def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> Any:
            clock.round_started()
            return super().configure_fit(server_round, parameters, client_manager)

        def aggregate_fit(self, server_round: int, results: Any, failures: Any) -> Any:
            aggregated = super().aggregate_fit(server_round, results, failures)
            clock.round_ended()
            if server_round == workload.rounds:
                final.append(parameters_to_ndarrays(aggregated[0]))
            return aggregated

    def server_fn(_: Context) -> ServerAppComponents:
        strategy = TimedFedAvg(
            fraction_fit=1.0,
            fraction_evaluate=0.0,
            min_fit_clients=devices,
            min_available_clients=devices,
            on_fit_config_fn=lambda server_round: {"round": server_round},
            initial_parameters=ndarrays_to_parameters(weights_of(workload.build_model())),
        )
        return ServerAppComponents(strategy=strategy, config=ServerConfig(workload.rounds))

    # Ray's actors unpickle the client by module name: run as __main__, it would travel by
    # value, and with it a fresh copy of the actor's cache on every fit
    from benchmarks.peers import flower as imported

    run_simulation(
        server_app=ServerApp(server_fn=server_fn),
        client_app=ClientApp(
            client_fn=imported.client_factory(arguments.workload, arguments.threads)
        ),
        num_supernodes=devices,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    if not final:
        msg = "Flower's simulation ended without aggregating the last round"
        raise SystemExit(msg)
    model = workload.build_model()
    set_weights(model, final[0])
    accuracy = common.mean_accuracy(model, workload.devices)
    common.write_result(arguments.result, clock.seconds(), accuracy, ("flwr", "ray"))


if __name__ == "__main__":
    main()
