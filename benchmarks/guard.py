"""What the personalization guard recovers where personal parts overfit: digits, 100 devices.

With about a dozen samples per device, FedAlt's personal heads overfit and hurt many devices
(docs/results.md). The guard (export issue) ships, per device, whichever of the personalized and
the non-personalized model scores better on the device's validation split. This runs the fleet,
then applies the guard on every device and scores the shipped model on its test split.

    python -m benchmarks.guard [--seeds 3]
"""

from __future__ import annotations

import argparse
import copy
import statistics

from benchmarks.common import one_thread
from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from device_agent.training import evaluate
from export import choose_model


def guarded_accuracy(seed: int, stateless: bool) -> dict[str, float]:
    """Mean test accuracy of personalized, global and guard-chosen models over the fleet."""
    settings = SimulationSettings.load(
        None, workers=1, task="digits", algorithm="fedalt", devices=100, pretrain_rounds=15,
        rounds=15,
        local_epochs=2, lr=0.1, alpha=0.3, seed=seed, stateless=stateless,
    )  # fmt: skip
    result = run_simulation(settings)
    personalized, global_scores, guarded, chose_global = [], [], [], 0
    for agent in result.agents:
        _, update, ctx = agent.exports.context()
        update.personalize(ctx)
        personal_model = copy.deepcopy(ctx.model)
        received = agent._model  # every device trained: each holds the decoded shared model
        assert received is not None
        assert received.decoded is not None
        agent._slots.load(received.decoded)  # the shared model with global starting points
        global_model = copy.deepcopy(agent.workspace)
        chosen, which, _ = choose_model(personal_model, global_model, agent.task, agent.data.val)
        personalized.append(evaluate(personal_model, agent.task, agent.data.test))
        global_scores.append(evaluate(global_model, agent.task, agent.data.test))
        guarded.append(evaluate(chosen, agent.task, agent.data.test))
        chose_global += which == "global"
    return {
        "personalized": statistics.mean(personalized),
        "global": statistics.mean(global_scores),
        "guarded": statistics.mean(guarded),
        "chose_global": chose_global,
    }


def main() -> None:
    """Print the table (docs/results.md quotes it)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    one_thread()
    print("| devices state | personalized | global | guarded | devices shipping global |")
    print("|---|---:|---:|---:|---:|")
    for stateless in (False, True):
        runs = [guarded_accuracy(seed, stateless) for seed in range(args.seeds)]
        mean = {k: statistics.mean(r[k] for r in runs) for k in runs[0]}
        print(
            f"| {'stateless' if stateless else 'stateful'} | {mean['personalized']:.3f} | "
            f"{mean['global']:.3f} | {mean['guarded']:.3f} | {mean['chose_global']:.0f} of 100 |"
        )


if __name__ == "__main__":
    main()
