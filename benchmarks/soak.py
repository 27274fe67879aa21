"""The long soak: agent processes behind shaped links, chaos between rounds, then the checks.

The driver is the short soak's (`tests/netlab/soak.py`, run in the suite by
tests/e2e/test_short_soak.py) at a size given here: a serving coordinator killed with SIGKILL
and resumed, then after each round one fault (an agent killed and restarted, the broker
restarted, one link partitioned and healed, every link cut). Single agents each have their own
fault proxy shaped as a link profile; with `--pools`, the rest of the fleet runs in
`pfl-agent pool` processes, each pool behind one proxy. Afterwards it checks what the suite
checks: every round recorded once, every device counted once per round, the model, every
device's last evaluation and each agent process's personal state equal to the fault-free
in-process run. The report goes to docs/benchmarks.md (a run with pools in a section of its own).

    python -m benchmarks.soak [--devices 20] [--rounds 12] [--out docs/benchmarks.md]
    python -m benchmarks.soak --devices 200 --rounds 100 --pools 4 --pool-devices 48
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import tempfile
from pathlib import Path

import torch

from benchmarks.common import markdown_table, one_thread, publish_section
from coordinator.run.simulate import SimulationResult
from tests.conftest import Mosquitto, free_port, mosquitto_binary
from tests.e2e.conftest import Processes
from tests.netlab.profiles import CONGESTED_WIFI, LOOPBACK, LTE, NB_IOT_LIKE
from tests.netlab.soak import (
    Soak,
    SoakPlan,
    SoakReport,
    evaluations,
    fault_free,
    personal_fingerprints,
)

MARKER = "<!-- soak -->"
POOLS_MARKER = "<!-- soak-pools -->"
"""A run with `pfl-agent pool` processes has a section of its own: the short run's stays."""


def check(report: SoakReport) -> dict[str, str]:
    """The soak's verdicts, each a short cell of the report table."""
    plan, result = report.plan, report.result
    if result is None:
        return {"rounds": "none: the run did not finish"}
    first = report.killed_coordinator_at + 1
    ids = [r.round_id for r in result.records]
    short = [r.round_id for r in result.records if r.participants != plan.devices]
    reference = fault_free(plan)
    equal = all(
        torch.equal(result.final_shared[name], tensor)
        for name, tensor in reference.final_shared.items()
    )
    own = evaluations(result.reports)
    same = sum(own.get(d) == e for d, e in evaluations(reference.reports).items())
    return {
        "rounds": f"{report.killed_coordinator_at} before the kill + {len(ids)} resumed "
        f"({'all' if ids == list(range(first, plan.rounds + 1)) else 'NOT all'} of "
        f"{first}..{plan.rounds}, each once)",
        "updates lost": str(sum(plan.devices - r.participants for r in result.records)),
        "resumed rounds' wall time (s)": _spread([r.wall_seconds for r in result.records]),
        "rounds short of a device": ", ".join(map(str, short)) or "none",
        "model equal to the fault-free run": "yes (bit for bit)" if equal else "NO",
        "personalized metrics equal": "yes"
        if result.summary.metrics == reference.summary.metrics
        else "NO",
        "each device's last evaluation equal": f"{same} of {plan.devices}",
        "personal state of the agent processes (sha256)": _states(report, reference),
    }


def _states(report: SoakReport, reference: SimulationResult) -> str:
    if report.state_root is None:
        return "not kept"
    prints = personal_fingerprints(report.state_root, reference.agents)
    differ = [device for device, (held, expected) in prints.items() if held != expected]
    return f"{len(prints) - len(differ)} of {len(prints)} equal" + (
        f" (differ: {', '.join(differ)})" if differ else ""
    )


def main() -> None:
    """Run the soak and write its report."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--pools", type=int, default=0, help="`pfl-agent pool` processes")
    parser.add_argument("--pool-devices", type=int, default=0, help="devices in each pool")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    parser.add_argument(
        "--workdir", type=Path, default=None, help="keep logs, state and checkpoints here"
    )
    parser.add_argument(
        "--states-of",
        type=Path,
        default=None,
        help="only compare the personal states a finished run with these flags left in its "
        "--workdir with the fault-free run's",
    )
    args = parser.parse_args()
    one_thread()
    logging.basicConfig(level=logging.ERROR, format="%(asctime)s %(message)s")
    logging.getLogger("tests.netlab.soak").setLevel(logging.INFO)  # a line per round
    plan = SoakPlan(
        devices=args.devices,
        rounds=args.rounds,
        links=(LTE, CONGESTED_WIFI, LOOPBACK, NB_IOT_LIKE),
        ceiling_s=1800.0,  # many agent processes start slowly on a small machine
        pools=args.pools,
        pool_devices=args.pool_devices,
        pool_links=(LTE, CONGESTED_WIFI, LOOPBACK),  # see SoakPlan.pool_links
    )
    if args.states_of is not None:
        report = SoakReport(plan, state_root=args.states_of / "state")
        print(
            f"personal state of the agent processes (sha256): {_states(report, fault_free(plan))}"
        )
        return
    with contextlib.ExitStack() as stack:
        if args.workdir is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        else:
            root = args.workdir
            root.mkdir(parents=True, exist_ok=False)
        broker = Mosquitto(mosquitto_binary(), root, free_port())
        broker.start()
        processes = Processes(root)
        try:
            report = Soak(plan, broker, processes, root).run()
        finally:
            processes.stop_all()
            broker.stop()
        verdicts = check(report)  # while the agents' state directories are there
    faults = ", ".join(f"{kind} {count}" for kind, count in report.counts().items())
    links = ", ".join(link.name for link in plan.links)
    rows = [
        ["devices", _fleet(plan)],
        [
            "links",
            f"{links} (single agent i: i mod 4); pools: "
            + ", ".join(plan.link(plan.singles + j).name for j in range(plan.pools))
            if plan.pools
            else f"{links} (device i: i mod 4)",
        ],
        ["duration (s)", f"{report.wall_seconds:.0f}"],
        ["load average (1 min, as rounds closed)", _load(report.load)],
        ["faults injected", faults],
        *[[name, value] for name, value in verdicts.items()],
        ["bytes through the links (up / down)", f"{report.bytes_up:,} / {report.bytes_down:,}"],
    ]
    publish_section(
        args.out,
        POOLS_MARKER if plan.pools else MARKER,
        [
            *(_POOLS_TEXT if plan.pools else _TEXT),
            "",
            *markdown_table(["", "result"], rows),
            "",
            f"Command: `python -m benchmarks.soak --devices {plan.devices} "
            f"--rounds {plan.rounds}{_pool_flags(plan)}`.",
        ],
    )


_TEXT = [
    "## Soak with chaos",
    "",
    "Agent processes (digits, Ditto) each behind its own shaped link; a serving coordinator "
    "killed with SIGKILL once a round is checkpointed and resumed; then, as each round closes, "
    "one fault before the next is announced (tests/netlab/soak.py). A short run, on a 2-core "
    "machine shared with other work; the long one is below. The suite runs the same driver "
    "smaller (tests/e2e/test_short_soak.py: 10 devices, 6 rounds, about 5 minutes here).",
]
_POOLS_TEXT = [
    "## Soak with chaos: 200 devices, over half an hour",
    "",
    "The same driver with most of the fleet in `pfl-agent pool` processes (200 agent processes "
    "would not fit in memory: in the run below a single agent held about 340 MB, a pool of 48 "
    "devices about 370 MB, resident as `ps` shows it). Each pool's devices reach the broker "
    "through one fault proxy shaped as the pool's link (every connection through it shaped on "
    "its own); each single agent through its own. The NB-IoT-like link is on single agents "
    "only: a pool connects its devices one after another, a few round trips each (about 18 s a "
    "device over that link in a first attempt here: a quarter of an hour for 48). Faults: the "
    "coordinator killed "
    "with SIGKILL after its first checkpointed round and resumed, then after each round one "
    "of: a single agent killed (SIGKILL) and restarted on its state directory (pools keep "
    "personal state in memory, so agent kills hit the single agents), the broker restarted "
    "with nothing kept, one proxy (a single agent's or a whole pool's) black-holed until its "
    "devices tried to come back and healed 3 s later, or every link cut at once. The checks "
    "are the short soak's, plus each agent process's personal state file compared by sha256 "
    "with the fault-free simulation's device.",
]


def _spread(values: list[float]) -> str:
    if not values:
        return "none"
    ordered = sorted(values)
    return f"median {ordered[len(ordered) // 2]:.1f}, max {ordered[-1]:.1f}"


def _fleet(plan: SoakPlan) -> str:
    if not plan.pools:
        return f"{plan.devices} (agent processes)"
    return (
        f"{plan.devices}: {plan.singles} agent processes + {plan.pools} `pfl-agent pool` "
        f"processes of {plan.pool_devices}"
    )


def _pool_flags(plan: SoakPlan) -> str:
    return f" --pools {plan.pools} --pool-devices {plan.pool_devices}" if plan.pools else ""


def _load(samples: list[float]) -> str:
    if not samples:
        return "none sampled"
    return f"{min(samples):.1f} to {max(samples):.1f}, mean {sum(samples) / len(samples):.1f}"


if __name__ == "__main__":
    main()
