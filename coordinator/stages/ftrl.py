"""DP-FTRL's tree aggregation: noisy prefix sums of the rounds' clipped sums, and their cost.

Kairouz et al. 2021, "Practical and Private (Deep) Learning without Sampling or Shuffling".
Round t's clipped sum x_t is a leaf of a binary tree; each complete dyadic node [j 2^h,
(j+1) 2^h) gets its own N(0, sigma^2) once, and the prefix x_1 + ... + x_t is released as the
sum of the (noisy) nodes of its dyadic decomposition: one per set bit of t, at most
floor(log2 t) + 1, so its noise variance is that many sigma^2 (not t sigma^2 as when every round
adds fresh noise). The model is the FTRL iterate theta_0 + lr * (noisy prefix) / m: a server
step of `lr` on each round's difference of noisy prefixes, which is what `increment` gives.

A tree may restart every `restart` rounds (a fresh tree, the completed trees' sums kept); the
noise of each node is drawn from a generator seeded by (seed, tree, level, index), so the tree's
whole state is its seed and a resumed run continues the same noise.

Privacy: all the complete nodes together are one Gaussian mechanism. A device in at most k
rounds of a tree of T leaves moves a node of 2^h leaves by at most min(k, 2^h) C, and the
worst pattern (k consecutive rounds from the tree's first) fills the nodes level by level, so
the squared L2 sensitivity is C^2 sum_h (q_h 4^h + r_h^2) over the levels with a complete node
(q_h, r_h = divmod(k, 2^h)). One round per tree gives ceil(log2(T + 1)) C^2; a device in every
round gives T (2T - 1) C^2 for T = 2^L: tree aggregation pays off only when participation is
limited (`participations`), as in the paper's one-pass-per-epoch setting. Trees compose as
Gaussians, so a run is one Gaussian of multiplier z / sqrt(sum over trees of that sum / C^2).
Adaptively chosen leaves (each round's update depends on the earlier releases) keep this
guarantee (Denisov et al. 2022, Theorem 2.1: the tree is a lower-triangular factorization).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch

from protocols.codec import Tensors


def prefix_nodes(t: int) -> list[tuple[int, int]]:
    """The dyadic nodes (level, index) whose leaves are exactly rounds 1..t, largest first.

    Node (h, j) covers the leaves j 2^h .. (j+1) 2^h - 1 (0-based); one node per set bit of t.
    """
    if t < 0:
        msg = f"a prefix has a non-negative length, got {t}"
        raise ValueError(msg)
    nodes = []
    start = 0
    for level in range(t.bit_length() - 1, -1, -1):
        if t >> level & 1:
            nodes.append((level, start >> level))
            start += 1 << level
    return nodes


def tree_sensitivity(leaves: int, participations: int | None = None) -> float:
    """Squared L2 sensitivity of all the complete nodes of a tree, in units of C^2.

    `leaves` rounds have been fed to the tree; a device joins at most `participations` of them
    (None: every one). See the module's docstring for why consecutive rounds are the worst.
    """
    k = leaves if participations is None else min(participations, leaves)
    total = 0
    level = 0
    while 1 << level <= leaves:
        width = 1 << level
        complete = leaves // width
        full, rest = divmod(k, width)
        total += min(full, complete) * width * width + (rest * rest if full < complete else 0)
        level += 1
    return float(total)


def run_sensitivity(rounds: int, restart: int | None, participations: int | None) -> float:
    """Squared sensitivity of a run's trees together (they compose as one Gaussian), / C^2."""
    if restart is None or rounds <= restart:
        return tree_sensitivity(rounds, participations)
    full, rest = divmod(rounds, restart)
    return full * tree_sensitivity(restart, participations) + tree_sensitivity(rest, participations)


def effective_multiplier(
    noise_multiplier: float, rounds: int, restart: int | None, participations: int | None
) -> float:
    """Z / sqrt(sensitivity^2 / C^2): the one Gaussian the run's releases amount to."""
    spread = run_sensitivity(rounds, restart, participations)
    return noise_multiplier / spread**0.5 if spread else float("inf")


class TreeNoise:
    """The noise of a run's trees: each round's increment of the noisy prefix sum's noise."""

    def __init__(self, seed: int, restart: int | None = None) -> None:
        if restart is not None and restart < 1:
            msg = f"a tree restarts after at least one round, got {restart}"
            raise ValueError(msg)
        self.seed = seed
        self.restart = restart
        self.rounds = 0
        self.resumed_at: list[int] = []
        """The round counts a run resumed at: a node ending after one is drawn anew."""
        self._cache: dict[tuple[int, int, int], Tensors] = {}

    def position(self, round_number: int) -> tuple[int, int]:
        """(tree, leaves of that tree up to and including `round_number`), 1-based rounds."""
        if self.restart is None:
            return 0, round_number
        tree, before = divmod(round_number - 1, self.restart)
        return tree, before + 1

    def prefix_noise(self, round_number: int, shapes: Mapping[str, torch.Tensor]) -> Tensors:
        """The noise (at std 1) of the current tree's prefix ending at `round_number`.

        Integer tensors (counters) get none, as with DP-FedAvg's noise.
        """
        tree, leaves = self.position(round_number)
        total = {n: torch.zeros(t.shape, dtype=torch.float64) for n, t in shapes.items()}
        floating = {n: t for n, t in shapes.items() if t.is_floating_point()}  # not counters
        for level, index in prefix_nodes(leaves):
            for name, value in self._node(tree, level, index, floating).items():
                total[name] += value
        return total

    def increment(self, shapes: Mapping[str, torch.Tensor], std: float) -> Tensors:
        """Next round's noise: its prefix's noise minus the previous prefix's (float64).

        Added to the round's sum, it releases the difference of two noisy prefix sums (a
        function of the tree's nodes); summed over rounds, the model carries one noisy prefix.
        """
        self.rounds += 1
        now = self.prefix_noise(self.rounds, shapes)
        tree, leaves = self.position(self.rounds)
        if leaves > 1:
            before = self.prefix_noise(self.rounds - 1, shapes)
            now = {n: now[n] - before[n] for n in now}
        self._forget(tree)
        return {n: v * std for n, v in now.items()}

    def state_dict(self) -> dict[str, object]:
        """All a resumed run needs: the noise of every node follows from the seed."""
        return {
            "seed": self.seed,
            "restart": self.restart,
            "rounds": self.rounds,
            "resumed_at": list(self.resumed_at),
        }

    @classmethod
    def resume(cls, state: Mapping[str, object]) -> TreeNoise:
        """The tree `state_dict` described, continuing with its next round.

        The nodes complete by then keep their noise (the model holds them); every node that
        ends later is drawn anew, since a round released after the checkpoint and lost with the
        coordinator may have used it with another cohort's sum (the same noise on two sums
        would give away their difference).

        Raises:
            ValueError: a state without an integer seed or round count.
        """
        seed, rounds, restart = state.get("seed"), state.get("rounds"), state.get("restart")
        resumed_at = state.get("resumed_at", [])
        if (
            not isinstance(seed, int)
            or not isinstance(rounds, int)
            or rounds < 0
            or not (restart is None or isinstance(restart, int))
            or not isinstance(resumed_at, list)
            or not all(isinstance(r, int) for r in resumed_at)
        ):
            msg = f"not a tree's state: {dict(state)}"
            raise ValueError(msg)
        tree = cls(seed, restart)
        tree.rounds = rounds
        tree.resumed_at = [*resumed_at, rounds]
        return tree

    def _node(
        self, tree: int, level: int, index: int, shapes: Mapping[str, torch.Tensor]
    ) -> Tensors:
        """A node's noise at std 1 for each of `shapes`' tensors.

        Each tensor's noise has its own generator, so it does not depend on which other tensors
        are shared: a stage that shares fewer (pretraining, then FedAlt) goes on with the same
        node noise for those it keeps, and no node is ever released with two draws.
        """
        key = (tree, level, index)
        node = self._cache.setdefault(key, {})
        first = 0 if self.restart is None else tree * self.restart  # the tree's first round
        last = first + ((index + 1) << level)  # 1-based: the node is complete after it
        generation = sum(last > resumed for resumed in self.resumed_at)
        for name, tensor in shapes.items():
            if name not in node or node[name].shape != tensor.shape:
                digest = hashlib.blake2b(
                    f"{self.seed}/{generation}/{tree}/{level}/{index}/{name}".encode(),
                    digest_size=8,
                ).digest()
                generator = torch.Generator().manual_seed(int.from_bytes(digest, "big") >> 1)
                node[name] = torch.randn(tensor.shape, generator=generator, dtype=torch.float64)
        return {name: node[name] for name in shapes}

    def _forget(self, tree: int) -> None:
        """Keep only the nodes the next prefix may reuse (those of this tree's current one)."""
        _, leaves = self.position(self.rounds)
        keep = {(tree, level, index) for level, index in prefix_nodes(leaves)}
        self._cache = {k: v for k, v in self._cache.items() if k in keep}


class ParticipationLimit:
    """A public rule: a device joins at most `limit` rounds of each tree (the accountant's k)."""

    def __init__(self, limit: int, restart: int | None) -> None:
        self.limit = limit
        self.restart = restart
        self.joined: dict[str, int] = {}
        self._tree = 0

    def allowed(self, round_number: int, device_ids: Sequence[str]) -> set[str]:
        """The devices of `device_ids` that may still join round `round_number`'s tree."""
        self._enter(round_number)
        return {d for d in device_ids if self.joined.get(d, 0) < self.limit}

    def count(self, round_number: int, selected: Sequence[str]) -> None:
        """Count a round's selected devices (selected, not answered: the rule stays public)."""
        self._enter(round_number)
        for device_id in selected:
            self.joined[device_id] = self.joined.get(device_id, 0) + 1

    def restore(self, joined: Mapping[str, int], rounds: int) -> None:
        """Continue after `rounds` rounds with these counts of the current tree."""
        self._enter(max(rounds, 1))
        self.joined = {str(d): int(n) for d, n in joined.items()}

    def _enter(self, round_number: int) -> None:
        tree = 0 if self.restart is None else (round_number - 1) // self.restart
        if tree != self._tree:
            self._tree, self.joined = tree, {}
