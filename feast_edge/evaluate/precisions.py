"""The precisions a served model can have, and the forms of an int8 file (names only: no onnx, torch or numpy here).

The protocol, the profile record and the registry name a precision; :mod:`feast_edge.evaluate.quantize` makes the
int8 files.
"""

PRECISIONS = ("fp32", "int8")
FORMS = ("onnxruntime", "tensorrt")  # int8 activations: unsigned with zero points, or symmetric signed (TensorRT)
