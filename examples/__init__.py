"""Runnable examples of bringing your own model and data (docs/own-task.md)."""
