"""The workload through `pfl-coord simulate` (`run_simulation`): coordinator, agents, codec, hub.

pfl-edge builds the devices' data itself from the task named in the workload's settings (the
harness wrote the workload's files from that very task, so the data are the same); its agents
draw their own minibatch order. The clock runs from round 1's start (its end less its own
`wall_seconds`) to the last round's end, so the final evaluation stays outside as in every
runner. Options: `--option batched=on|off|auto --option workers=N`.

    python -m benchmarks.peers.edge --workload DIR --result FILE [--option KEY=VALUE ...]
"""

from __future__ import annotations

import time

from benchmarks.peers import common
from coordinator.engine.round_types import RoundRecord
from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation


def main() -> None:
    """Run the workload in `run_simulation` and write the result."""
    arguments, workload = common.start_run(__doc__ or "")
    options = dict(option.split("=", 1) for option in arguments.option)
    settings = SimulationSettings.load(None, **{**workload.settings["simulation"], **options})
    ends: list[tuple[float, RoundRecord]] = []

    def on_round(record: RoundRecord) -> None:
        ends.append((time.perf_counter(), record))

    result = run_simulation(settings, on_round=on_round)
    first_end, first = ends[0]
    # every round's callback but the last comes right after its round ends; the last one's
    # comes after the final evaluation, so its end is the round before's plus its own length
    last_end = ends[-2][0] + ends[-1][1].wall_seconds if len(ends) > 1 else first_end
    model = workload.build_model()
    model.load_state_dict({**model.state_dict(), **result.final_shared})
    accuracy = common.mean_accuracy(model, workload.devices)
    common.write_result(
        arguments.result,
        last_end - (first_end - first.wall_seconds),
        accuracy,
        ("pfl-edge",),
        batched=settings.batched,
        workers=settings.workers,
    )


if __name__ == "__main__":
    main()
