"""The one error export raises on purpose, so callers can report a failed export to the fleet."""

from __future__ import annotations

from protocols.errors import PflError


class ExportError(PflError):
    """The model cannot be exported, or the exported file does not behave like the model.

    Raised for a forward pass that fails on the task's sample input, a torch.onnx failure, an
    fp32 parity difference above the tolerance, or a file that cannot be written atomically.
    """
