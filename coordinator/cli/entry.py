"""The `pfl-coord` console script, importing the CLI inside it (see `protocols.extras`).

On an agent-only install a command that reaches one of the coordinator's packages (amqtt for the
embedded broker, scikit-learn for the digits data, ...), at import or while it runs, ends with
the line naming the `coord` extra rather than a traceback.
"""

from __future__ import annotations

from protocols.extras import run_program


def main() -> None:
    """Run `pfl-coord`."""
    run_program("coordinator.cli.app")


if __name__ == "__main__":
    main()
