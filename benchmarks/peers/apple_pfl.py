"""The workload in Apple's pfl (`pip install "pfl[pytorch]"`): its FederatedAveraging, simulated.

pfl's `SimulatedBackend` trains each sampled user in turn in this process, weights each update
by the user's data points (`WeightByDatapoints`) and applies the mean with a central SGD of
learning rate 1 (so the new model is the weighted mean, as FedAvg). A user's dataset is built
when pfl samples it, in that round's `common.epoch_orders` (pfl's own `Dataset` iterates in
order; with more than one local epoch every epoch repeats the first one's order). pfl's
evaluation before and after each user's training is switched off, as in every runner. The clock
starts in pfl's `on_train_begin` callback and stops after the last central iteration.

    python -m benchmarks.peers.apple_pfl --workload DIR --result FILE
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch
from torch import nn

from benchmarks.peers import common


class UserModel(nn.Module):
    """The workload's model with the `loss` and `metrics` methods pfl's PyTorchModel calls."""

    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        self.network = network

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """The wrapped model's logits."""
        outputs: torch.Tensor = self.network(inputs)
        return outputs

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor, eval: bool = False) -> Any:
        """Mean cross-entropy over the batch."""
        self.train(not eval)
        return common.loss(self(inputs), targets)

    @torch.no_grad()
    def metrics(self, inputs: torch.Tensor, targets: torch.Tensor, eval: bool = False) -> Any:
        """Summed loss, as pfl's metrics (unused: evaluation is off)."""
        from pfl.metrics import Weighted

        self.train(not eval)
        summed = float(nn.functional.cross_entropy(self(inputs), targets, reduction="sum"))
        return {"loss": Weighted(summed, len(targets))}


def main() -> None:
    """Run the workload in pfl's simulation and write the result."""
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics
    from pfl.model.pytorch import PyTorchModel

    arguments, workload = common.start_run(__doc__ or "")
    devices = len(workload.devices)
    clock = common.RoundClock()
    sampled = [0] * devices

    def user_dataset(device: int) -> Any:
        data = workload.devices[device]
        order = common.epoch_orders(len(data.train_y), sampled[device], device, 1)[0]
        sampled[device] += 1
        return Dataset(raw_data=[data.train_x[order], data.train_y[order]], user_id=device)

    class Timer(TrainingProcessCallback):  # type: ignore[misc]
        def on_train_begin(self, *, model: Any) -> Any:
            clock.round_started()
            return Metrics()

        def after_central_iteration(self, aggregate_metrics: Any, model: Any, **_: Any) -> Any:
            clock.round_ended()
            return False, Metrics()

    class QuietFedAvg(FederatedAveraging):  # type: ignore[misc]
        """FedAvg without pfl's per-user evaluation in the first iteration."""

        def get_next_central_contexts(self, *args: Any, **kwargs: Any) -> Any:
            contexts, model, metrics = super().get_next_central_contexts(*args, **kwargs)
            if contexts is not None:
                contexts = tuple(dataclasses.replace(c, do_evaluation=False) for c in contexts)
            return contexts, model, metrics

    network = UserModel(workload.build_model())
    model = PyTorchModel(
        model=network,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(network.parameters(), lr=1.0),
    )
    users = FederatedDataset(user_dataset, itertools.cycle(range(devices)).__next__)
    QuietFedAvg().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=workload.rounds,
            evaluation_frequency=workload.rounds,
            train_cohort_size=devices,
            val_cohort_size=0,
        ),
        backend=SimulatedBackend(
            training_data=users, val_data=users, postprocessors=[WeightByDatapoints()]
        ),
        model=model,
        model_train_params=NNTrainHyperParams(
            local_num_epochs=workload.local_epochs,
            local_learning_rate=workload.lr,
            local_batch_size=workload.batch_size,
        ),
        model_eval_params=NNEvalHyperParams(local_batch_size=None),
        callbacks=[Timer()],
    )
    accuracy = common.mean_accuracy(network.network, workload.devices)
    common.write_result(arguments.result, clock.seconds(), accuracy, ("pfl",))


if __name__ == "__main__":
    main()
