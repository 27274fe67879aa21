"""`pfl-coord` whose DP noise is seeded, so that two runs of it draw the same noise.

A real coordinator draws its noise from the OS's entropy: no two runs compare. A test that
compares a killed and resumed run with an uninterrupted one seeds both (`seeded_generator`), running
the killed one as `python -m seeded_noise serve ...` (tests/e2e is on its path).
"""

from __future__ import annotations

import torch

import coordinator.stages.privacy as privacy

NOISE_SEED = 20261126


def seeded_generator(reproducible_seed: int | None) -> torch.Generator:
    """`noise_generator`, with NOISE_SEED for the OS's entropy."""
    seed = NOISE_SEED if reproducible_seed is None else reproducible_seed
    return torch.Generator().manual_seed(seed)


if __name__ == "__main__":
    from coordinator.cli.app import app

    privacy.noise_generator = seeded_generator  # type: ignore[attr-defined]  # the seam is the import
    app()
