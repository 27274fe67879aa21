"""Where a device's local update runs: at once (`Immediate`), or with its process's others.

A device agent hands its round's update and context to a `LocalTrainer` with what to do with
the result; the answer (privatized, masked or compressed, framed) then goes through the same
uplink either way. `Batched` keeps the handed work until the process has no message left to
deliver (`flush`), then trains the devices that run the same phases of the same algorithm as
one stacked computation (`device_agent.batched.stacked`) and answers each in the order they
came; whatever cannot batch runs per device, its reason logged once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from time import perf_counter
from typing import Protocol

from device_agent.algorithms.base import (
    BatchPhase,
    LocalContext,
    LocalResult,
    LocalUpdate,
    batch_phases,
)
from device_agent.batched.stacked import Member, Trained, model_problem, train_stacked
from device_agent.training import ModelSlots, combine_stats, difference

logger = logging.getLogger(__name__)

Done = Callable[[LocalResult], None]
"""What the device does with its result: answer through its uplink."""
Failed = Callable[[Exception], None]
"""What the device does when its update failed: decline the round with the reason."""


class LocalTrainer(Protocol):
    """Runs devices' local updates and hands each result back."""

    def submit(self, update: LocalUpdate, ctx: LocalContext, done: Done, failed: Failed) -> None:
        """Run `update` on `ctx` (now or at the next flush), then `done(result)`."""
        ...


class Immediate:
    """The null trainer: each update runs when handed over; its errors reach the caller."""

    def submit(self, update: LocalUpdate, ctx: LocalContext, done: Done, failed: Failed) -> None:
        """Run now and answer."""
        del failed
        done(update.run(ctx))


@dataclass
class _Work:
    update: LocalUpdate
    ctx: LocalContext
    done: Done
    failed: Failed
    phases: tuple[BatchPhase, ...] | None = None
    rounds: RunStacked | None = None
    """The update's own stacked rounds (`StackedUpdate`), when it has no phases."""


RunStacked = Callable[[Sequence[LocalContext]], list[LocalResult]]


class StackedUpdate(LocalUpdate, Protocol):
    """A device half that trains many devices' rounds at once itself (pFedMe, pFedBreD).

    Each of `run_stacked`'s results is what `run` returns on its context, to float rounding;
    it draws from each context's generator what `run` draws.
    """

    def run_stacked(self, contexts: Sequence[LocalContext]) -> list[LocalResult]:
        """`run` of every context (one config), as one stacked computation."""
        ...


class Batched:
    """Keeps the process's handed updates and trains them together at `flush`."""

    def __init__(self) -> None:
        self._waiting: list[_Work] = []
        self._devices: set[str] = set()
        """The devices of `_waiting`."""
        self._told: set[str] = set()
        self.stacked_rounds = 0
        """Device rounds trained stacked so far (for tests and the benchmark)."""
        self.stacked_seconds = 0.0
        """Time spent in `train_stacked` so far: what the benchmark tells apart from the rest."""

    def submit(self, update: LocalUpdate, ctx: LocalContext, done: Done, failed: Failed) -> None:
        """Keep the work until `flush`.

        Work the same device still waits for is trained first: its next round starts from the
        state that one keeps.
        """
        if ctx.device_id in self._devices:
            self.flush()
        self._waiting.append(_Work(update, ctx, done, failed))
        self._devices.add(ctx.device_id)

    def pending(self) -> bool:
        """Whether work waits for a flush."""
        return bool(self._waiting)

    def flush(self) -> None:
        """Train what waits (stacked where it can), then answer each device in turn."""
        waiting, self._waiting = self._waiting, []
        self._devices.clear()
        if not waiting:
            return
        groups: dict[str, list[_Work]] = {}
        problems: dict[int, str | None] = {}  # virtual devices share one workspace model
        for work in waiting:
            reason = self._reason_apart(work, problems)
            if reason is not None:
                self._tell(reason)
                work.phases = work.rounds = None  # trained through its own `run`
                groups.setdefault(f"alone-{id(work)}", []).append(work)
            elif work.rounds is not None:  # its rounds stack only with the same settings
                key = (work.update.name, work.ctx.config, work.ctx.split)
                groups.setdefault(repr(key), []).append(work)
            else:
                groups.setdefault(repr((work.update.name, work.phases)), []).append(work)
        results: dict[int, LocalResult | Exception] = {}
        logger.debug("batched training: groups of %s", [len(g) for g in groups.values()])
        for group in groups.values():
            results.update(self._train_group(group))
        for work in waiting:
            outcome = results[id(work)]
            try:
                if isinstance(outcome, Exception):
                    raise outcome
                work.done(outcome)
            except Exception as error:  # the device declines, the others answer
                work.failed(error)

    def _reason_apart(self, work: _Work, problems: dict[int, str | None]) -> str | None:
        """Why `work` cannot train stacked (None: it can); `problems` memoizes each model's."""
        ctx = work.ctx
        try:
            work.phases = batch_phases(work.update, ctx)
        except Exception as error:  # the device's own run will say it, per device
            return f"{work.update.name}: its phases could not be planned ({error})"
        if work.phases is None:
            work.rounds = getattr(work.update, "run_stacked", None)
        if work.phases is None and work.rounds is None:
            return f"{work.update.name} trains per device (its update declares no phases)"
        if ctx.budget.micro_batch_size is not None or ctx.budget.meter is not None:
            return "a memory plan or work limits bound the steps of each device"
        if id(ctx.model) not in problems:
            problems[id(ctx.model)] = model_problem(ctx.model)
        return problems[id(ctx.model)]

    def _train_group(self, group: list[_Work]) -> dict[int, LocalResult | Exception]:
        """Stacked, even a group of one: a device's result must not depend on its company."""
        if group[0].rounds is not None:
            try:
                return self._rounds(group, group[0].rounds)
            except Exception as error:
                self._tell(f"stacked training failed, trained per device instead: {error}")
        elif group[0].phases is not None:
            try:
                return self._stacked(group)
            except Exception as error:
                self._tell(f"stacked training failed, trained per device instead: {error}")
        return {id(work): _alone(work) for work in group}

    def _stacked(self, group: list[_Work]) -> dict[int, LocalResult | Exception]:
        first = group[0]
        phases = first.phases
        assert phases is not None  # grouped by them
        ctx0 = first.ctx
        members = [
            Member(
                split=w.ctx.data.train,
                generator=w.ctx.generator,
                start={**w.ctx.global_shared, **w.ctx.personal},
                reference=w.ctx.global_shared,
                state=w.ctx.state,
            )
            for w in group
        ]
        started = perf_counter()
        try:
            with _draws_kept_on_failure(group):
                trained = train_stacked(ctx0.model, ctx0.task, members, phases)
        finally:
            self.stacked_seconds += perf_counter() - started
        self.stacked_rounds += len(group)
        return {
            id(work): _result(work.ctx, phases, outcome)
            for work, outcome in zip(group, trained, strict=True)
        }

    def _rounds(self, group: list[_Work], run: RunStacked) -> dict[int, LocalResult | Exception]:
        """The group's rounds through the update's own `run_stacked`."""
        with _draws_kept_on_failure(group):
            results = run([w.ctx for w in group])
        self.stacked_rounds += len(group)
        return {id(work): result for work, result in zip(group, results, strict=True)}

    def _tell(self, reason: str) -> None:
        if reason not in self._told:
            self._told.add(reason)
            logger.info("batched training: %s", reason)


@contextmanager
def _draws_kept_on_failure(group: list[_Work]) -> Iterator[None]:
    """Put each device's generator back if the body fails, for the per-device fallback."""
    generators = [w.ctx.generator.get_state() for w in group]
    try:
        yield
    except Exception:
        for work, generator in zip(group, generators, strict=True):
            work.ctx.generator.set_state(generator)
        raise


def _alone(work: _Work) -> LocalResult | Exception:
    """One device's round through its own `run`, from the context it was handed with."""
    ctx = work.ctx
    slots = ctx.slots or ModelSlots(ctx.model)
    try:
        slots.load(ctx.global_shared)  # the workspace held another device's model meanwhile
        slots.load(ctx.personal)
        return work.update.run(ctx)
    except Exception as error:
        return error


def _result(ctx: LocalContext, phases: tuple[BatchPhase, ...], trained: Trained) -> LocalResult:
    """What `run_phases` reports for the `trained` member."""
    live = {**ctx.global_shared, **ctx.personal, **trained.final}
    stats = [s for s, phase in zip(trained.stats, phases, strict=True) if phase.counted]
    combined = stats[0] if len(stats) == 1 else combine_stats(*stats)
    return LocalResult(
        shared_delta=difference(live, ctx.global_shared),
        num_samples=len(ctx.data.train),
        train_loss=combined.mean_loss,
        personal={name: live[name].clone() for name in ctx.split.personal},
        state={name: value.clone() for name, value in trained.kept.items()},
    )
