"""Device updates with random shared deltas and chosen sample counts, for aggregation tests."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from coordinator.strategies.base import ReceivedUpdate


def random_updates(
    rng: np.random.Generator, counts: list[int], shapes: Mapping[str, tuple[int, ...]]
) -> list[ReceivedUpdate]:
    """One update per count from devices dev-0, dev-1, ..., deltas ~ N(0, 1) in float32."""
    return [
        ReceivedUpdate(
            device_id=f"dev-{i}",
            num_samples=count,
            train_loss=1.0,
            shared_delta={
                name: torch.tensor(rng.normal(size=shape), dtype=torch.float32)
                for name, shape in shapes.items()
            },
        )
        for i, count in enumerate(counts)
    ]
