"""Run an exported ONNX file in onnxruntime and print what ran it, as JSON on stdout.

benchmarks/arm64_check.py runs this same file on the emulated arm64 device and on the host, so the
two outputs can be compared: the arm64 export verified on arm64, and the same numbers on x86.

    python benchmarks/arm64_probe.py MODEL.onnx
"""

from __future__ import annotations

import json
import platform
import sys
from importlib import metadata

import numpy as np
import onnxruntime

from export import read_metadata

PACKAGES = ("torch", "onnxruntime", "onnx", "numpy", "pfl-edge")


def probe(path: str) -> dict[str, object]:
    """Versions of what runs here, the file's metadata and its outputs on a fixed batch."""
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    feed = session.get_inputs()[0]
    width = int(feed.shape[-1])
    batch = np.linspace(0.0, 16.0, 4 * width, dtype=np.float32).reshape(4, width)
    (outputs,) = session.run(None, {feed.name: batch})
    tags = read_metadata(path)
    return {
        "machine": platform.machine(),
        "python": platform.python_version(),
        "versions": {name: metadata.version(name) for name in PACKAGES},
        "device_id": tags.get("pfl.device_id"),
        "round": tags.get("pfl.round"),
        "algorithm": tags.get("pfl.algorithm"),
        "output_shape": list(outputs.shape),
        "outputs": np.asarray(outputs, dtype=np.float64).tolist(),
    }


if __name__ == "__main__":
    json.dump(probe(sys.argv[1]), sys.stdout)
