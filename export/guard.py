"""The personalization guard: ship the global model when personalizing made a device worse."""

from __future__ import annotations

import logging
import math

from torch import nn

from pfl_tasks.base import Split, Task

from .metadata import Chosen
from .parity import metric_of, torch_predictor

logger = logging.getLogger(__name__)


def choose_model(
    personalized: nn.Module, global_model: nn.Module, task: Task, validation_split: Split
) -> tuple[nn.Module, Chosen, dict[str, float]]:
    """Pick whichever model scores better on the device's own validation split.

    Personalization can hurt a device (too little data, labels unlike its training data); a
    deployer should never receive a model worse than the fleet's. Accuracy is better when higher,
    MSE when lower; ties, an empty split and a NaN score on both sides go to the personalized
    model, since that is what the device trained for. A model whose score is NaN loses to one
    whose score is finite.

    Returns:
        The chosen module (the object passed in, not a copy), which one it is, and both scores
        keyed "personalized" and "global". Both modules keep their train/eval mode.
    """
    scores = {
        "personalized": _score(personalized, task, validation_split),
        "global": _score(global_model, task, validation_split),
    }
    mine, fleet = scores["personalized"], scores["global"]
    if math.isnan(mine) and not math.isnan(fleet):
        chosen: Chosen = "global"
    elif math.isnan(fleet):
        chosen = "personalized"
    elif task.metric_name == "mse":
        chosen = "global" if fleet < mine else "personalized"
    else:
        chosen = "global" if fleet > mine else "personalized"
    if len(validation_split) == 0:
        logger.warning("empty validation split: the guard keeps the personalized model")
    elif chosen == "global":
        logger.info(
            "personalization guard: global model wins on validation %s (%.4g vs personalized %.4g)",
            task.metric_name,
            fleet,
            mine,
        )
    return (global_model if chosen == "global" else personalized), chosen, scores


def _score(model: nn.Module, task: Task, split: Split) -> float:
    was_training = model.training
    try:
        return metric_of(torch_predictor(model), task, split)
    finally:
        model.train(was_training)
