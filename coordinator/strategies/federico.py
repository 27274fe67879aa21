"""FedeRiCo, coordinator half (federico.md §3.2, §3.3 B): the registry of models and the relay.

The coordinator keeps every device's model and its owner's Adam state, serves each device the
models it sampled (only those it does not already hold), and applies each model's summed
contributions with its owner's optimizer. It never sees a loss or a collaborator weight: those
stay on the devices, folded into the contributions before they are sent.

Memory: one model per device, plus Adam's two moments per device in "gradient" mode, i.e.
3 x 4 bytes per parameter per device (docs/algorithms/federico.md states the cost).
"""

from __future__ import annotations

import hashlib
import logging
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from coordinator.engine.selection import select_devices
from coordinator.strategies.base import (
    Aggregate,
    FleetSnapshot,
    ModelBuilder,
    ReceivedUpdate,
    Relay,
    RoundPlan,
)
from protocols.algorithms import (
    FEDERICO_COLLABORATORS,
    FEDERICO_ENTROPY,
    AlgorithmConfig,
    FedericoConfig,
)
from protocols.codec import Tensors, describe_tensors, join_owners, model_digest, split_owners
from protocols.errors import RoundError
from protocols.messages import PeerRequest, RelayedModel, TensorSpec

logger = logging.getLogger(__name__)


def owner_seed(seed: int, owner: str) -> int:
    """The seed of `owner`'s independently initialized model, identical in every process."""
    digest = hashlib.sha256(f"{seed}/{owner}/federico-init".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@dataclass
class OwnerAdam:
    """One owner's Adam state (float32 moments), as torch.optim.Adam keeps it."""

    step: int = 0
    first: Tensors = field(default_factory=dict)
    second: Tensors = field(default_factory=dict)

    @torch.no_grad()
    def apply(
        self, model: Tensors, gradient: Mapping[str, torch.Tensor], config: FedericoConfig
    ) -> None:
        """One Adam step on `model` in place, with torch.optim.Adam's formula and order."""
        self.step += 1
        beta1, beta2 = config.adam_beta1, config.adam_beta2
        correction1, correction2 = 1 - beta1**self.step, 1 - beta2**self.step
        for name, grad in gradient.items():
            first = self.first.setdefault(name, torch.zeros_like(grad))
            second = self.second.setdefault(name, torch.zeros_like(grad))
            first.lerp_(grad, 1 - beta1)
            second.mul_(beta2).addcmul_(grad, grad.conj(), value=1 - beta2)
            denominator = (second.sqrt() / correction2**0.5).add_(config.adam_eps)
            model[name].addcdiv_(first, denominator, value=-config.lr / correction1)


class FedericoStrategy:
    """Per-owner sums of the devices' weighted contributions, applied by the owner's optimizer.

    "gradient" mode (the paper's M-step): S_b = sum_i w_ib grad_b(sum_s loss_i), then
    Adam_b(phi_b, S_b). "delta" mode: phi_b + sum_i w_ib (local copy - phi_b).
    """

    name: ClassVar[str] = "federico"
    config_type: ClassVar[type[AlgorithmConfig]] = FedericoConfig

    def __init__(self, config: AlgorithmConfig, participation: float) -> None:
        if not isinstance(config, FedericoConfig):
            msg = f"federico needs FedericoConfig, got {type(config).__name__}"
            raise TypeError(msg)
        self.config: FedericoConfig = config
        self.participation = participation
        self.models: dict[str, Tensors] = {}
        self.digests: dict[str, str] = {}
        self.optimizers: dict[str, OwnerAdam] = {}
        self._template: Tensors = {}
        self._build: ModelBuilder | None = None
        self._seed = 0
        self._known: set[str] = set()

    # -- relay --------------------------------------------------------------------------------

    def bind(self, template: Tensors, build_model: ModelBuilder | None, seed: int) -> None:
        """The model layout, the task's initializer (None = every model starts as `template`)."""
        self._template = {name: value.detach().clone() for name, value in template.items()}
        self._build = build_model
        self._seed = seed

    def candidates(self, fleet: FleetSnapshot) -> tuple[str, ...]:
        """Every device the registry knows, online or not: an offline owner's model stays here."""
        self._known = {device.device_id for device in fleet.devices} | set(self.models)
        return tuple(sorted(self._known))

    def relay(self, round_id: int, request: PeerRequest) -> Relay:
        """The requested models the device lacks; unknown owners come back as missing.

        Raises:
            RoundError: a training request that does not start with the device itself or asks
                for more than `neighbours` peers.
        """
        device_id = request.device_id
        if request.phase == "train":
            peers = len(request.models) - 1
            if request.models[0] != device_id or peers > self.config.neighbours:
                msg = (
                    f"a training request lists the device itself first and at most "
                    f"{self.config.neighbours} peers; got {list(request.models)}"
                )
                raise RoundError(msg, device_id=device_id, round_id=round_id)
        served, missing, sent = [], [], {}
        for owner in request.models:
            if owner not in self._known and owner not in self.models and owner != device_id:
                missing.append(owner)
                continue
            model = self._model(owner)
            digest = self.digests[owner]
            changed = request.cached.get(owner) != digest
            served.append(RelayedModel(owner=owner, digest=digest, sent=changed))
            if changed:
                sent[owner] = model
        if missing:
            logger.info(
                "round %d: %s asked for unknown model(s) %s: skipped",
                round_id,
                device_id,
                ", ".join(missing),
            )
        expected: tuple[TensorSpec, ...] = ()
        if request.phase == "train":
            contributions = join_owners(
                {
                    item.owner: {
                        name: value
                        for name, value in self.models[item.owner].items()
                        if value.is_floating_point()
                    }
                    for item in served
                }
            )
            expected = describe_tensors(contributions)
        return Relay(tuple(served), tuple(missing), join_owners(sent), expected)

    def _model(self, owner: str) -> Tensors:
        model = self.models.get(owner)
        if model is None:
            if self.config.init == "independent" and self._build is not None:
                model = dict(self._build(owner_seed(self._seed, owner)))
            else:
                model = {name: value.clone() for name, value in self._template.items()}
            self.models[owner] = model
            self.digests[owner] = model_digest(model)
        return model

    # -- rounds -------------------------------------------------------------------------------

    def plan_round(
        self, round_id: int, fleet: FleetSnapshot, rng: np.random.Generator
    ) -> RoundPlan:
        """Online devices, sampled with the participation fraction."""
        del round_id
        online = fleet.online()
        if not online:
            return RoundPlan(())
        return RoundPlan(select_devices(online, self.participation, rng))

    def aggregate(
        self, round_id: int, shared: Tensors, updates: Sequence[ReceivedUpdate]
    ) -> Aggregate:
        """Sum the contributions per owner and step each contributed-to model once."""
        del round_id
        sums: dict[str, Tensors] = defaultdict(dict)
        contributors: dict[str, int] = defaultdict(int)
        for update in updates:
            for owner, contribution in split_owners(update.shared_delta).items():
                for name, value in contribution.items():
                    total = sums[owner].get(name)
                    sums[owner][name] = value.clone() if total is None else total.add_(value)
                contributors[owner] += 1
        for owner in sorted(sums):
            model = self._model(owner)
            if self.config.mstep == "gradient":
                optimizer = self.optimizers.setdefault(owner, OwnerAdam())
                optimizer.apply(model, sums[owner], self.config)
            else:
                with torch.no_grad():
                    for name, value in sums[owner].items():
                        model[name].add_(value.to(model[name].dtype))
            self.digests[owner] = model_digest(model)
        scalars = {
            "models_updated": float(len(sums)),
            "contributions_per_model": statistics.fmean(contributors.values())
            if contributors
            else 0.0,
        }
        for key in (FEDERICO_ENTROPY, FEDERICO_COLLABORATORS):
            values = [u.scalars[key] for u in updates if key in u.scalars]
            if values:
                scalars[f"mean_{key}"] = statistics.fmean(values)
        return Aggregate(dict(shared), scalars)

    # -- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, object]:
        """Owners, digests and Adam step counts (the tensors go to `state_tensors`)."""
        return {
            "owners": sorted(self.models),
            "digests": dict(self.digests),
            "adam_steps": {owner: opt.step for owner, opt in self.optimizers.items()},
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore the bookkeeping; `load_state_tensors` brings the tensors."""
        steps = state.get("adam_steps", {})
        if not isinstance(steps, Mapping):
            msg = "federico state needs a mapping 'adam_steps'"
            raise ValueError(msg)
        self.optimizers = {str(owner): OwnerAdam(int(step)) for owner, step in steps.items()}
        self.models, self.digests = {}, {}

    def state_tensors(self) -> Tensors:
        """Every model and Adam moment as `model/<owner>/<name>`, `adam1/...`, `adam2/...`."""
        tensors: Tensors = {}
        for owner, model in self.models.items():
            tensors.update({f"model/{owner}/{name}": value for name, value in model.items()})
        for owner, opt in self.optimizers.items():
            tensors.update({f"adam1/{owner}/{name}": value for name, value in opt.first.items()})
            tensors.update({f"adam2/{owner}/{name}": value for name, value in opt.second.items()})
        return tensors

    def load_state_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Rebuild the models and moments `state_tensors()` wrote."""
        for key, value in tensors.items():
            kind, owner, name = key.split("/", 2)
            if kind == "model":
                self.models.setdefault(owner, {})[name] = value.clone()
            else:
                opt = self.optimizers.setdefault(owner, OwnerAdam())
                (opt.first if kind == "adam1" else opt.second)[name] = value.clone()
        self.digests = {owner: model_digest(model) for owner, model in self.models.items()}
