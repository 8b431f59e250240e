"""Pallas GPU kernels and the pure-JAX references they are tested against.

dequant_matmul: y = x @ dequantize(W)^T over GGUF blocks kept packed (reference implemented;
the Pallas kernel is tracked by the kernels issue).
"""

from pallas_kernels.dequant_matmul import dequant_matmul_reference

__all__ = ["dequant_matmul_reference"]
