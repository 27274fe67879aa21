"""A device's evaluation: its personalized model's test metric, and the global model's if any.

A non-finite personalized metric means nothing can be reported (the round is declined); a
non-finite global one is left out of the report with a warning.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from torch import nn

from device_agent.algorithms.base import LocalContext, LocalUpdate
from device_agent.relay import deployable, has_global_model
from device_agent.training import evaluate
from pfl_tasks.base import Split, Task
from protocols.errors import TrainingError

logger = logging.getLogger(__name__)


def evaluated(
    update: LocalUpdate,
    ctx: LocalContext,
    task: Task,
    test: Split,
    global_model: Callable[[], nn.Module],
    round_id: int,
) -> tuple[float, float | None]:
    """(personalized, global) test metrics; `global_model` loads the round's global model.

    Raises:
        TrainingError: the personalized metric is not finite.
    """
    personalized = evaluate(deployable(update, ctx), task, test)
    if not math.isfinite(personalized):
        msg = (
            f"the personalized model's test {task.metric_name} is {personalized} "
            "(diverged training, or an empty test split): nothing to report"
        )
        raise TrainingError(msg, device_id=ctx.device_id, round_id=round_id)
    if not has_global_model(update, ctx):  # no shared + personal starting points
        return personalized, None
    global_metric = evaluate(global_model(), task, test)
    if math.isfinite(global_metric):
        return personalized, global_metric
    logger.warning(
        "device %s: the global model's test %s is %s: not reported",
        ctx.device_id,
        task.metric_name,
        global_metric,
    )
    return personalized, None
