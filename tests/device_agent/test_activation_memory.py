"""The plan's activation memory against the peak a training step really reaches.

Each model is measured in a fresh interpreter: the kernel's peak resident set (VmHWM, reset
through /proc/self/clear_refs) over two training steps, less the resident set before them, per
sample. The plan's figure (probed, before its margin; or counted with saved-tensor hooks, with
the allowance a checkpointed count carries for the allocator it cannot see) must be within a
factor of 2 of it either way.
"""

import json
import subprocess
import sys

import pytest

from device_agent.memory_plan import CHECKPOINTED_PROBE_MARGIN, PROBE_MARGIN, SAFETY_MARGIN

FACTOR = 2.0
BATCH = 128

_SCRIPT = """
import json, sys
import torch
from benchmarks.memory_conv import SignalTask
from device_agent.checkpointing import checkpointed
from device_agent.memory_plan import (
    _CLEAR_REFS, _peak_rss_bytes, current_rss_bytes, memory_model, release_free_heap,
)
from pfl_tasks.split import ParamSplit

name, batch, checkpointing = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
torch.set_num_threads(1)
task = SignalTask(name)
model = task.build_model(0)
data = task.signals(batch)
split = ParamSplit.for_model(model, ())
planned = {}
for probe in (True, False):
    terms = memory_model(model, task, data, split, runtime_bytes=0, probe=probe)
    planned[terms.method] = terms.per_sample(checkpointing=checkpointing)
forward = checkpointed(model) if checkpointing else model
task.loss(forward(data.inputs[:8]), data.targets[:8]).backward()
release_free_heap()
_CLEAR_REFS.write_text("5")
before = current_rss_bytes()
for _ in range(2):
    model.zero_grad(set_to_none=True)
    task.loss(forward(data.inputs), data.targets).backward()
measured = (_peak_rss_bytes() - before) / batch
print(json.dumps({"planned": planned, "measured": measured}))
"""


@pytest.mark.parametrize(
    ("model", "checkpointing"), [("cnn", False), ("cnn", True), ("gru", False)]
)
def test_planned_activations_are_within_a_factor_of_the_measured_peak(
    model: str, checkpointing: bool
) -> None:
    output = subprocess.run(
        [sys.executable, "-c", _SCRIPT, model, str(BATCH), "1" if checkpointing else "0"],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    result = json.loads(output.stdout.strip().splitlines()[-1])
    measured = float(result["measured"])
    assert set(result["planned"]) == {"probe", "estimate"}
    # the probe's own reading: the margins (measured over longer training runs, docs/memory.md)
    # come on top of it; a count is planned as it stands
    margin = CHECKPOINTED_PROBE_MARGIN if checkpointing else PROBE_MARGIN
    for method, planned in result["planned"].items():
        ratio = planned / (1 + margin if method == "probe" else 1) / measured
        assert 1 / FACTOR <= ratio <= FACTOR, (method, planned, measured)


PEAK_CEILING = 1.35


def test_the_plan_of_a_wide_mlp_update_is_near_its_measured_peak() -> None:
    # The 5M-parameter MLP of benchmarks/memory.py, one unconstrained update of 2048 samples
    # held as an agent holds it, in a fresh interpreter: the planned peak covers the measured
    # one without the over-count that refused every budget of its table (planned 1.5x measured)
    output = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory", "--child", "[null, 0]"],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    result = json.loads(output.stdout.strip().splitlines()[-1])
    planned, measured = int(result["estimated_peak"]), int(result["peak"])
    # a plan is accepted only with SAFETY_MARGIN of the budget above the runtime to spare: that
    # margin, not the bare estimate, is what must cover what varies between processes
    runtime = int(result["baseline"])
    covered = planned + SAFETY_MARGIN * (planned - runtime)
    assert measured <= covered, (planned, measured)
    assert planned <= PEAK_CEILING * measured, (planned, measured)
