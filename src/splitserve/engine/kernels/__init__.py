"""CPU kernels for decode, JIT-compiled at first use; each falls back to torch.

from splitserve.engine.kernels.linear import linear, kernel_available
"""
