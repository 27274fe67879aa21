"""A weighted mixture of models as one module: what FedeRiCo deploys, exported as one graph.

Classification mixes predictive distributions, as the mixture likelihood implies (federico.md
§6.9): the module returns log(sum_j w_j softmax(h_j(x))), computed stably with logsumexp, so its
argmax is the mixture's label and its softmax the mixture's probabilities. Regression mixes the
outputs: sum_j w_j h_j(x).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

MixtureKind = Literal["probabilities", "outputs"]


class MixtureModel(nn.Module):
    """sum_j w_j h_j(x) over `components`, with the weights renormalized to sum to one.

    Raises:
        ValueError: no component, a weight count that differs, or weights that are negative,
            non-finite or all zero.
    """

    weights: torch.Tensor
    log_weights: torch.Tensor

    def __init__(
        self, components: Sequence[nn.Module], weights: Sequence[float], kind: MixtureKind
    ) -> None:
        super().__init__()
        if not components or len(components) != len(weights):
            msg = (
                f"a mixture needs one weight per component, "
                f"got {len(components)} and {len(weights)}"
            )
            raise ValueError(msg)
        values = torch.tensor([float(w) for w in weights], dtype=torch.float32)
        if not torch.isfinite(values).all() or (values < 0).any() or values.sum() <= 0:
            msg = f"mixture weights must be finite, non-negative and not all zero: {weights}"
            raise ValueError(msg)
        self.components = nn.ModuleList(components)
        self.kind = kind
        self.register_buffer("weights", values / values.sum())
        self.register_buffer("log_weights", torch.log(values / values.sum()))

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The mixture's log-probabilities (classification) or weighted outputs (regression)."""
        outputs = torch.stack([component(*inputs) for component in self.components])
        if self.kind == "outputs":
            shape = (-1,) + (1,) * (outputs.dim() - 1)
            return (outputs * self.weights.view(shape)).sum(dim=0)
        log_probabilities = torch.log_softmax(outputs, dim=-1)
        shape = (-1,) + (1,) * (log_probabilities.dim() - 1)
        return torch.logsumexp(log_probabilities + self.log_weights.view(shape), dim=0)
