"""Quantized weights kept in their format: the weight type every linear layer takes beside a
plain tensor (`weight.py`). The formats and the kernels that compute on them are
engine/kernels/quant.*."""
