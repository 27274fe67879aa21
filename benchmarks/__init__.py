"""Reproducible benchmarks that write their tables into docs/."""
