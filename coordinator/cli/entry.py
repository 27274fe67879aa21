"""The `pfl-coord` console script, importing the CLI inside it (see `protocols.extras`).

The CLI's module imports the coordinator's packages: on an agent-only install that import itself
fails, and must end with the line naming the `coord` extra rather than a traceback.
"""

from __future__ import annotations

from protocols.extras import run_program


def main() -> None:
    """Run `pfl-coord`."""
    run_program("coordinator.cli.app")


if __name__ == "__main__":
    main()
