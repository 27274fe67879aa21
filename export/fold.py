"""BatchNorm folded into the convolution or linear layer before it, for inference.

In eval mode BatchNorm is an affine map per channel with fixed statistics, so a preceding
Conv/Linear can absorb it: w' = w * gamma / sqrt(var + eps), b' = (b - mean) * gamma /
sqrt(var + eps) + beta. The exported graph then has one layer where it had two, and the
BatchNormalization node disappears. Only pairs whose order is certain are folded: consecutive
children of an `nn.Sequential` (a forward() may use its modules in any order).
"""

from __future__ import annotations

from itertools import pairwise
from typing import Final

import onnx
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval, fuse_linear_bn_eval

CONVOLUTIONS: Final = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
BATCH_NORM_OP: Final = "BatchNormalization"


def fold_batch_norms(model: nn.Module) -> int:
    """Fold every BatchNorm that directly follows a Conv or Linear in a Sequential; in place.

    The folded BatchNorm becomes `nn.Identity`, so indices (and state_dict names of the other
    layers) stay. `model` must be in eval mode: folding uses the running statistics.

    Returns:
        How many BatchNorm layers were folded.

    Raises:
        ValueError: `model` is in training mode.
    """
    if model.training:
        msg = "fold BatchNorm only into a model in eval mode: it uses the running statistics"
        raise ValueError(msg)
    folded = 0
    for sequential in [m for m in model.modules() if isinstance(m, nn.Sequential)]:
        names = list(sequential._modules)
        for before, after in pairwise(names):
            layer, norm = sequential._modules[before], sequential._modules[after]
            fused = _fused(layer, norm)
            if fused is not None:
                sequential._modules[before] = fused
                sequential._modules[after] = nn.Identity()
                folded += 1
    return folded


def _fused(layer: nn.Module | None, norm: nn.Module | None) -> nn.Module | None:
    """`layer` with `norm` folded in, or None when the pair cannot be folded."""
    if not isinstance(norm, nn.modules.batchnorm._BatchNorm) or norm.running_mean is None:
        return None
    if isinstance(layer, CONVOLUTIONS) and layer.out_channels == norm.num_features:
        return fuse_conv_bn_eval(layer, norm)
    if not isinstance(layer, nn.Linear) or not isinstance(norm, nn.BatchNorm1d):
        return None
    return fuse_linear_bn_eval(layer, norm) if layer.out_features == norm.num_features else None


def batch_norm_nodes(model_bytes: bytes) -> int:
    """BatchNormalization nodes left in an ONNX graph (0 once every BatchNorm is folded)."""
    graph = onnx.load_from_string(model_bytes).graph
    return sum(node.op_type == BATCH_NORM_OP for node in graph.node)
