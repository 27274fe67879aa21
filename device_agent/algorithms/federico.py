"""FedeRiCo, device half (federico.md §2.3): choose peers, E-step, weighted contributions.

The device keeps, per model owner, the last loss it measured (ell), their moving average (L)
and whether it has ever evaluated that model; its collaborator weights w = softmax(-L / tau)
follow from them. None of this leaves the device: w is folded into the contributions, and the
update carries only those and a few aggregate scalars (the weights' entropy and how many
models carry weight).

A round: sample M peers epsilon-greedily on w (`sample_peers`), receive their models and its
own from the coordinator, measure each model's loss on the training split (the own model
always, §6.1), update L and w, and send each model's owner w_ib times the model's full-batch
gradient of the summed loss ("gradient") or of its delta after local epochs ("delta").
Prediction is the w-weighted mixture of the models it has evaluated (`export.mixture`).
"""

from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

import numpy as np
import torch
from torch import nn

from device_agent.algorithms.base import (
    LocalContext,
    LocalResult,
    phase_spec,
    require_config,
    train_phase,
)
from device_agent.training import (
    ModelSlots,
    difference,
    snapshot,
)
from pfl_tasks.base import Split
from protocols.algorithms import FEDERICO_COLLABORATORS, FEDERICO_ENTROPY, FedericoConfig
from protocols.codec import Tensors, join_owners
from protocols.errors import StateError
from protocols.own_packages import own_module

if TYPE_CHECKING:  # at run time, our export package even where a user's export.py shadows it
    from export.mixture import MixtureKind, MixtureModel

OWNERS = "federico.owners"
LAST_LOSS = "federico.last_loss"
AVERAGE_LOSS = "federico.average_loss"
SEEN = "federico.seen"
Phase = Literal["train", "evaluate"]
logger = logging.getLogger(__name__)


@dataclass
class Collaborators:
    """Per-owner loss memory on this device, and the weights it implies (never sent)."""

    owners: list[str]
    last_loss: np.ndarray
    average_loss: np.ndarray
    seen: np.ndarray

    @classmethod
    def from_state(cls, state: Mapping[str, torch.Tensor], owners: Sequence[str]) -> Collaborators:
        """The stored memory, extended by owners not met before (loss 0, unseen: Alg. 1 l.3)."""
        if OWNERS in state:
            known = json.loads(bytes(state[OWNERS].tolist()).decode())
            memory = cls(
                list(known),
                state[LAST_LOSS].double().numpy().copy(),
                state[AVERAGE_LOSS].double().numpy().copy(),
                state[SEEN].bool().numpy().copy(),
            )
        else:
            memory = cls([], np.zeros(0), np.zeros(0), np.zeros(0, dtype=bool))
        new = [owner for owner in dict.fromkeys(owners) if owner not in memory.owners]
        if new:
            memory.owners += new
            memory.last_loss = np.concatenate([memory.last_loss, np.zeros(len(new))])
            memory.average_loss = np.concatenate([memory.average_loss, np.zeros(len(new))])
            memory.seen = np.concatenate([memory.seen, np.zeros(len(new), dtype=bool)])
        return memory

    def as_state(self) -> Tensors:
        """Tensors for the state store (owner ids as UTF-8 JSON bytes: no pickle)."""
        encoded = json.dumps(self.owners).encode()
        return {
            OWNERS: torch.tensor(list(encoded), dtype=torch.uint8),
            LAST_LOSS: torch.from_numpy(self.last_loss.copy()),
            AVERAGE_LOSS: torch.from_numpy(self.average_loss.copy()),
            SEEN: torch.from_numpy(self.seen.astype(np.uint8)),
        }

    def observe(self, losses: Mapping[str, float], config: FedericoConfig) -> None:
        """The E-step's bookkeeping: refresh the evaluated losses, then track every owner's.

        "ema" moves every entry, stale ones included, toward its last loss with weight beta on
        the newest (Alg. 1 l.10-14); "cumulative" adds the fresh losses only (exact EM, §1.8).
        """
        index = {owner: i for i, owner in enumerate(self.owners)}
        fresh = np.zeros(len(self.owners), dtype=bool)
        for owner, loss in losses.items():
            self.last_loss[index[owner]] = loss
            self.seen[index[owner]] = True
            fresh[index[owner]] = True
        if config.loss_tracking == "ema":
            beta = config.beta
            self.average_loss = (1 - beta) * self.average_loss + beta * self.last_loss
        else:
            self.average_loss = self.average_loss + np.where(fresh, self.last_loss, 0.0)

    def weights(self, config: FedericoConfig) -> np.ndarray:
        """The weights softmax(-L / tau); unseen models masked out under "mask" and whenever M = 0.

        Shifted by the maximum, so huge summed losses stay finite; with nothing seen yet under
        masking the weights are uniform.
        """
        logits = -self.average_loss / config.tau
        if (config.unseen_policy == "mask" or config.neighbours == 0) and self.seen.any():
            logits = np.where(self.seen, logits, -np.inf)
        logits = logits - logits.max()
        exp = np.exp(logits)
        weights: np.ndarray = exp / exp.sum()
        return weights

    def mixture_weights(self, config: FedericoConfig) -> np.ndarray:
        """The weights prediction uses: over evaluated models only (spec §6.2), renormalized.

        Sampling may rank never-evaluated models first (the optimistic zero loss); predicting
        with them would mix untrained models in, so inference always masks them.
        """
        if not self.seen.any():
            return np.zeros(len(self.owners))
        logits = np.where(self.seen, -self.average_loss / config.tau, -np.inf)
        exp = np.exp(logits - logits.max())
        weights: np.ndarray = exp / exp.sum()
        return weights

    def members(self, config: FedericoConfig) -> list[str]:
        """The mixture: evaluated models with w >= min_weight, heaviest first, at most top_k."""
        weights = self.mixture_weights(config)
        order = sorted(range(len(self.owners)), key=lambda i: (-weights[i], self.owners[i]))
        chosen = [i for i in order if self.seen[i] and weights[i] >= config.min_weight]
        return [self.owners[i] for i in chosen[: config.top_k]]


def sample_peers(
    owners: Sequence[str],
    weights: np.ndarray,
    self_id: str,
    config: FedericoConfig,
    rng: np.random.Generator,
) -> list[str]:
    """M distinct peers, never self: with probability epsilon uniformly, else the top-M by w.

    "per_round" tosses one coin for the whole sample (§6.3); "per_slot" one per slot, each
    taking a uniform or the heaviest remaining peer. Ties are broken at random.
    """
    candidates = [i for i, owner in enumerate(owners) if owner != self_id]
    count = min(config.neighbours, len(candidates))
    if count == 0:
        return []
    if config.sampling == "per_round":
        if rng.random() < config.epsilon:
            chosen = list(rng.choice(candidates, size=count, replace=False))
        else:
            ties = rng.random(len(owners))
            chosen = sorted(candidates, key=lambda i: (-weights[i], ties[i]))[:count]
    else:
        remaining, chosen = list(candidates), []
        for _ in range(count):
            if rng.random() < config.epsilon:
                pick = remaining[int(rng.integers(len(remaining)))]
            else:
                ties = rng.random(len(remaining))
                pick = min(
                    zip(remaining, ties, strict=True), key=lambda item: (-weights[item[0]], item[1])
                )[0]
            remaining.remove(pick)
            chosen.append(pick)
    return [owners[int(i)] for i in chosen]


def summed_loss_and_gradient(
    model: nn.Module, ctx: LocalContext, chunk: int
) -> tuple[float, Tensors]:
    """sum_s loss(h(x_s), y_s) over the training split and its gradient, in micro-batches."""
    model.train()
    model.zero_grad(set_to_none=True)
    split, total = ctx.data.train, torch.zeros((), dtype=torch.float64)
    for start in range(0, len(split), chunk):
        inputs, targets = split.inputs[start : start + chunk], split.targets[start : start + chunk]
        loss = ctx.task.loss(model(inputs), targets) * int(inputs.shape[0])
        loss.backward()
        total += loss.detach().double()
    parameters = dict(model.named_parameters())
    gradients = {name: p.grad for name, p in parameters.items() if p.grad is not None}
    gradient = {
        name: (gradients[name].detach().clone() if name in gradients else torch.zeros_like(value))
        for name, value in model.state_dict().items()
        if value.is_floating_point()
    }
    model.zero_grad(set_to_none=True)
    return float(total), gradient


@torch.no_grad()
def summed_loss(model: nn.Module, ctx: LocalContext, split: Split, chunk: int) -> float:
    """sum_s loss(h(x_s), y_s) over `split`, without gradients."""
    model.eval()
    total = 0.0
    for start in range(0, len(split), chunk):
        inputs, targets = split.inputs[start : start + chunk], split.targets[start : start + chunk]
        total += float(ctx.task.loss(model(inputs), targets)) * int(inputs.shape[0])
    return total


def sampling_rng(ctx: LocalContext) -> np.random.Generator:
    """The round's sampling generator, drawn from the context's seeded torch generator."""
    seed = int(torch.randint(0, 2**62, (1,), generator=ctx.generator))
    return np.random.default_rng(seed)


def entropy(weights: np.ndarray) -> float:
    """H(w) in nats."""
    positive = weights[weights > 0]
    return float(-(positive * np.log(positive)).sum())


class FedericoUpdate:
    """The device's E-step and M-step contributions over the models the coordinator relayed."""

    name: ClassVar[str] = "federico"
    relays: ClassVar[bool] = True

    def choose_models(self, ctx: LocalContext, phase: Phase) -> tuple[str, ...]:
        """Training: the device itself, then its sampled peers. Evaluation: its mixture."""
        cfg = require_config(ctx, FedericoConfig)
        memory = Collaborators.from_state(ctx.state, (ctx.device_id, *ctx.peers))
        if phase == "evaluate":
            return tuple(memory.members(cfg)) or (ctx.device_id,)
        weights = memory.weights(cfg)
        peers = sample_peers(memory.owners, weights, ctx.device_id, cfg, sampling_rng(ctx))
        return (ctx.device_id, *peers)

    def run(self, ctx: LocalContext) -> LocalResult:
        """Evaluate every relayed model, update w, and weight each model's contribution."""
        cfg = require_config(ctx, FedericoConfig)
        memory = Collaborators.from_state(ctx.state, (ctx.device_id, *ctx.peers))
        count = len(ctx.data.train)
        chunk = ctx.budget.micro_batch_size or cfg.batch_size
        holdout = ctx.data.val if cfg.estep_data == "validation" and len(ctx.data.val) else None
        estep_count = count if holdout is None else len(holdout)
        slots = ModelSlots(ctx.model)
        losses: dict[str, float] = {}
        raw: dict[str, Tensors] = {}
        for owner, model in ctx.peer_models.items():
            slots.load(model)
            if holdout is not None:
                losses[owner] = summed_loss(ctx.model, ctx, holdout, chunk)
            if cfg.mstep == "gradient":
                train_loss, raw[owner] = summed_loss_and_gradient(ctx.model, ctx, chunk)
            else:
                train_loss = summed_loss(ctx.model, ctx, ctx.data.train, chunk)
                raw[owner] = self._local_delta(ctx, cfg, model)
            losses.setdefault(owner, train_loss)
        scale = 1.0 if cfg.loss_reduction == "sum" else 1.0 / max(estep_count, 1)
        memory.observe({owner: loss * scale for owner, loss in losses.items()}, cfg)
        weights = dict(zip(memory.owners, memory.weights(cfg), strict=True))
        contributions = join_owners(
            {
                owner: {name: float(weights[owner]) * value for name, value in tensors.items()}
                for owner, tensors in raw.items()
            }
        )
        evaluated = sum(weights[owner] for owner in losses)
        mean_loss = (
            sum(weights[owner] * losses[owner] for owner in losses)
            / evaluated
            / max(estep_count, 1)
            if evaluated > 0
            else statistics.fmean(losses.values()) / max(estep_count, 1)
        )
        all_weights = np.array(list(weights.values()))
        return LocalResult(
            shared_delta=contributions,
            num_samples=count,
            train_loss=mean_loss,
            personal={},
            scalars={
                FEDERICO_ENTROPY: entropy(all_weights),
                FEDERICO_COLLABORATORS: float(len(memory.members(cfg))),
            },
            state=memory.as_state(),
        )

    def _local_delta(self, ctx: LocalContext, cfg: FedericoConfig, model: Tensors) -> Tensors:
        """The delta of `local_epochs` SGD epochs at `local_lr` on the unweighted loss (§2.3)."""
        names = tuple(name for name, _ in ctx.model.named_parameters())
        spec = phase_spec(
            ctx, names, epochs=cfg.local_epochs, lr=cfg.local_lr, max_steps=cfg.max_steps
        )
        train_phase(ctx, spec)
        floats = [name for name, value in model.items() if value.is_floating_point()]
        return difference(snapshot(ctx.model, floats), {name: model[name] for name in floats})

    def personalize(self, ctx: LocalContext) -> None:
        """The deployed model is the mixture (`deployable`), not a change to ctx.model."""
        del ctx

    def deployable(self, ctx: LocalContext) -> nn.Module:
        """The w-weighted mixture of the relayed models in this device's mixture.

        Raises:
            StateError: none of the mixture's models has been received.
        """
        cfg = require_config(ctx, FedericoConfig)
        memory = Collaborators.from_state(ctx.state, (ctx.device_id, *ctx.peers))
        weights = dict(zip(memory.owners, memory.mixture_weights(cfg), strict=True))
        wanted = memory.members(cfg)
        members = [owner for owner in wanted if owner in ctx.peer_models]
        if len(members) < len(wanted):
            logger.warning(
                "device %s: mixing %d of its %d collaborators' models (the others were not "
                "relayed since the last evaluation)",
                ctx.device_id,
                len(members),
                len(wanted),
            )
        if not memory.seen.any():  # before any training round: the device's own model
            members = [ctx.device_id] if ctx.device_id in ctx.peer_models else []
            weights = {ctx.device_id: 1.0}
        if not members:
            msg = "none of this device's collaborators' models has been received yet"
            raise StateError(msg, device_id=ctx.device_id)
        components = []
        for owner in members:
            component = ctx.task.build_model(0)
            ModelSlots(component).load(ctx.peer_models[owner])
            components.append(component)
        kind: MixtureKind = "probabilities" if ctx.task.metric_name == "accuracy" else "outputs"
        # loaded here: the export package brings onnx and onnxruntime, which training never needs
        mixture: type[MixtureModel] = own_module("export.mixture").MixtureModel
        return mixture(components, [weights[owner] for owner in members], kind)
