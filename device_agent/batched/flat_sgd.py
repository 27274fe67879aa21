"""All devices' parameters as one [D, P] tensor, and torch.optim.SGD's arithmetic on it.

Keeping every parameter of every device in one flat tensor makes an optimizer step a handful of
whole-tensor operations (no per-parameter or per-device Python), and a device's gradient norm a
single row norm.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from device_agent.training import TrainSpec


class FlatLayout:
    """Where each named parameter lives in a row of the flat [D, P] tensor.

    Matrices named in `transposed` are stored transposed ([in, out] for a Linear weight), the
    layout a batched matrix product reads and writes without copies.
    """

    def __init__(self, model: nn.Module, transposed: frozenset[str] = frozenset()) -> None:
        named = list(model.named_parameters())
        self.names = [name for name, _ in named]
        self.transposed = {name for name, p in named if name in transposed and p.dim() == 2}
        self.shapes = [
            tuple(p.shape[::-1]) if name in self.transposed else tuple(p.shape) for name, p in named
        ]
        self.sizes = [math.prod(shape) for shape in self.shapes]
        self.width = sum(self.sizes)

    def stack(self, rows: Sequence[Mapping[str, torch.Tensor]]) -> torch.Tensor:
        """[D, P]: each device's tensors of `self.names`, flattened side by side."""
        parts = []
        for name in self.names:
            part = torch.stack([row[name].detach() for row in rows])
            if name in self.transposed:
                part = part.transpose(1, 2)
            parts.append(part.reshape(len(rows), -1))
        return torch.cat(parts, dim=1)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The parameters as stored, [D, *shape] views of `flat` (gradients flow back into it)."""
        parts = flat.split(self.sizes, dim=1)
        return {
            name: part.unflatten(1, shape) if shape else part.squeeze(1)
            for name, shape, part in zip(self.names, self.shapes, parts, strict=True)
        }

    def rows(self, flat: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """Each device's tensors in the model's own shapes, as views of one copy of `flat`."""
        copies = []
        for name, stacked in self.views(flat.detach()).items():
            turned = name in self.transposed
            copies.append(stacked.transpose(1, 2).contiguous() if turned else stacked.clone())
        return [
            dict(zip(self.names, (part[i] for part in copies), strict=True))
            for i in range(flat.shape[0])
        ]

    def columns(self, values: Mapping[str, float], default: float = 0.0) -> torch.Tensor:
        """[P]: each parameter's value from `values` repeated over its columns."""
        return torch.cat(
            [
                torch.full((size,), float(values.get(name, default)))
                for name, size in zip(self.names, self.sizes, strict=True)
            ]
        )


class FlatSgd:
    """torch.optim.SGD (weight decay, momentum, no dampening) on [D, P], device by device.

    Devices whose steps are over (inactive) stay as they are and keep their momentum; a frozen
    parameter's columns neither move nor count in the gradient norm; clipping is each device's
    own, as `clip_grad_norm_` on its trainable parameters alone.
    """

    def __init__(self, spec: TrainSpec, layout: FlatLayout) -> None:
        self.spec = spec
        rates = {name: spec.lr_by_name.get(name, spec.lr) for name in spec.trainable}
        self.neg_lr = -layout.columns(rates).unsqueeze(0)  # [1, P]; 0 where frozen
        self.frozen = len(set(spec.trainable)) < len(layout.names)
        self.trainable = layout.columns(dict.fromkeys(spec.trainable, 1.0)).unsqueeze(0)
        self.buffer: torch.Tensor | None = None
        self.finite = torch.ones((), dtype=torch.bool)
        """False once some active device's gradient norm was non-finite (checked at the end)."""

    @torch.no_grad()
    def step(self, flat: torch.Tensor, grad: torch.Tensor, active: torch.Tensor) -> None:
        """One step of every active device; `grad` is zero for inactive ones and is consumed."""
        spec = self.spec
        if self.frozen:
            grad.mul_(self.trainable)
        if spec.clip_grad_norm is not None:
            norm = torch.linalg.vector_norm(grad, dim=1)
            self.finite &= torch.isfinite(norm[active]).all()
            scale = torch.clamp(spec.clip_grad_norm / (norm + 1e-6), max=1.0)
            grad.mul_(scale.unsqueeze(1))
        moving = active.to(flat.dtype).unsqueeze(1)  # [D, 1]
        if spec.weight_decay:
            grad.addcmul_(flat, moving, value=spec.weight_decay)
        if spec.momentum:
            if self.buffer is None:
                self.buffer = grad.clone()
            else:
                keep = torch.where(active, spec.momentum, 1.0).to(flat.dtype).unsqueeze(1)
                self.buffer.mul_(keep).add_(grad)
            flat.addcmul_(self.buffer, self.neg_lr * moving)
        else:
            flat.addcmul_(grad, self.neg_lr)
