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
        """[D, P]: each device's tensors of `self.names`, flattened side by side.

        A tensor every row shares (the received model, where nothing of it is personal) is
        broadcast instead of stacked from D references to it: the copy is made once, by `cat`.
        """
        parts = []
        for name in self.names:
            if len(rows) > 1 and all(row[name] is rows[0][name] for row in rows):
                first = rows[0][name].detach()
                part = first.unsqueeze(0).expand(len(rows), *first.shape)
            else:
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
    """torch.optim.SGD (weight decay, momentum, no dampening) on the rows still training.

    Rows are ordered by their number of steps, so the devices still training at any step are
    the first `n` rows and devices whose steps are over are not touched (their momentum stays).
    A frozen parameter's columns neither move nor count in the gradient norm; clipping is each
    device's own, as `clip_grad_norm_` on its trainable parameters alone.
    """

    def __init__(self, spec: TrainSpec, layout: FlatLayout) -> None:
        self.spec = spec
        rates = {name: spec.lr_by_name.get(name, spec.lr) for name in spec.trainable}
        self.neg_lr = -layout.columns(rates).unsqueeze(0)  # [1, P]; 0 where frozen
        self.uniform = set(spec.trainable) == set(layout.names) and not spec.lr_by_name
        self.trainable = layout.columns(dict.fromkeys(spec.trainable, 1.0)).unsqueeze(0)
        self.buffer: torch.Tensor | None = None
        self.finite = torch.ones((), dtype=torch.bool)
        """False once some device's gradient norm was non-finite (read when the phase ends)."""

    @torch.no_grad()
    def step(self, rows: torch.Tensor, grad: torch.Tensor, devices: int) -> None:
        """One step of the first `len(rows)` of `devices` devices; `grad` is consumed."""
        spec = self.spec
        if not self.uniform:
            grad.mul_(self.trainable)
        if spec.clip_grad_norm is not None:
            norm = torch.linalg.vector_norm(grad, dim=1)
            self.finite &= torch.isfinite(norm).all()
            grad.mul_(torch.clamp(spec.clip_grad_norm / (norm + 1e-6), max=1.0).unsqueeze(1))
        if spec.weight_decay:
            grad.add_(rows, alpha=spec.weight_decay)
        update = grad
        if spec.momentum:
            if self.buffer is None:  # the first step: every device with a step takes part
                self.buffer = torch.zeros(devices, rows.shape[1], dtype=rows.dtype)
                self.buffer[: len(rows)] = grad
            else:
                self.buffer[: len(rows)].mul_(spec.momentum).add_(grad)
            update = self.buffer[: len(rows)]
        if self.uniform:
            rows.add_(update, alpha=-spec.lr)
        else:
            rows.addcmul_(update, self.neg_lr)
