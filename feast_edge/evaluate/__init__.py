"""Evaluation (method §8): per-variant BN recalibration, accuracy, and the self-describing ONNX export."""
