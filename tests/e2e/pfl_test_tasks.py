"""A digits task whose shared model has about 10M parameters, to push chunking both ways."""

from __future__ import annotations

from collections import OrderedDict
from typing import ClassVar

from torch import nn

from pfl_tasks.digits import NUM_CLASSES, NUM_PIXELS, DigitsTask
from pfl_tasks.models import build_seeded

WIDE = 3200


class BigDigitsTask(DigitsTask):
    """Digits with a 3200x3200 hidden layer (10.5M parameters, about 42 MB in float32)."""

    name: ClassVar[str] = "big-digits"

    def build_model(self, seed: int) -> nn.Module:
        """An MLP with one very wide square layer."""
        return build_seeded(
            seed,
            lambda: nn.Sequential(
                OrderedDict(
                    hidden=nn.Linear(NUM_PIXELS, WIDE),
                    act=nn.ReLU(),
                    wide=nn.Linear(WIDE, WIDE),
                    act2=nn.ReLU(),
                    output=nn.Linear(WIDE, NUM_CLASSES),
                )
            ),
        )
