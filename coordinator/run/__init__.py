"""Programs that run a federation (simulate, serve, compare), their settings and checkpoints."""
