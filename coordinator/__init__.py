"""The coordinator side of pfl-edge: round engine, fleet registry, strategies, simulation, CLI."""
