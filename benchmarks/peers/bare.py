"""The bare loop: FedAvg over the workload's devices with nothing but PyTorch.

The floor every framework's sequential simulation stands on: per round each device loads the
global weights, runs `common.local_sgd`, and the sample-weighted mean of the deltas becomes the
new global model.

    python -m benchmarks.peers.bare --workload DIR --result FILE
"""

from __future__ import annotations

import torch

from benchmarks.peers import common


def fedavg(workload: common.Workload, clock: common.RoundClock) -> torch.nn.Module:
    """Every round's local updates in turn, then the weighted mean of their deltas."""
    model = workload.build_model()
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    total = sum(len(d.train_y) for d in workload.devices)
    for round_index in range(workload.rounds):
        clock.round_started()
        mean_delta = {k: torch.zeros_like(v) for k, v in global_state.items()}
        for device, data in enumerate(workload.devices):
            model.load_state_dict(global_state)
            common.local_sgd(model, workload, device, round_index)
            weight = len(data.train_y) / total
            for name, value in model.state_dict().items():
                mean_delta[name].add_(value - global_state[name], alpha=weight)
        global_state = {k: v + mean_delta[k] for k, v in global_state.items()}
        clock.round_ended()
    model.load_state_dict(global_state)
    return model


def main() -> None:
    """Run the workload and write the result."""
    arguments, workload = common.start_run(__doc__ or "")
    clock = common.RoundClock()
    model = fedavg(workload, clock)
    accuracy = common.mean_accuracy(model, workload.devices)
    common.write_result(arguments.result, clock.seconds(), accuracy, ())


if __name__ == "__main__":
    main()
