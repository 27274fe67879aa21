"""Personalized model to ONNX, with an onnxruntime parity check and provenance metadata."""
