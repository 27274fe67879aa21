"""The packages stay layered: no import cycles, and each package imports only the layers below.

protocols <- pfl_tasks <- export <- device_agent <- coordinator; the coordinator reaches the
device agent only to run virtual devices (simulate) and to document both command lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocols", "pfl_tasks", "export", "device_agent", "coordinator")
ALLOWED = {
    "protocols": set(),
    "pfl_tasks": {"protocols"},
    "export": {"protocols", "pfl_tasks"},
    "device_agent": {"protocols", "pfl_tasks", "export"},
    "coordinator": {"protocols", "pfl_tasks", "export", "device_agent"},
}
COORDINATOR_USES_OF_THE_AGENT = {
    "coordinator.run.simulate",
    "coordinator.run.simulation_workers",  # runs the virtual devices in its worker processes
    "coordinator.cli.docs",
}


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_module_imports_itself_through_others() -> None:
    assert _cycle(_imports(_modules())) is None


def test_packages_import_only_the_layers_below_them() -> None:
    graph = _imports(_modules())
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if target.split(".")[0] != module.split(".")[0]
        and target.split(".")[0] not in ALLOWED[module.split(".")[0]]
    )
    assert upward == []
    to_agent = {
        m
        for m, ts in graph.items()
        if m.startswith("coordinator.") and any(t.startswith("device_agent") for t in ts)
    }
    assert to_agent <= COORDINATOR_USES_OF_THE_AGENT


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
