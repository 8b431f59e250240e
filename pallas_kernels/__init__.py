"""Pallas GPU kernels (Triton lowering) and the pure-JAX references they are tested against.

dequant_matmul: y = x @ dequantize(W)^T reading GGUF blocks kept packed (Q4_0 Q4_1 Q5_0 Q5_1
  Q8_0 Q4_K Q5_K Q6_K), with `dequant_matmul_reference`.
tree_gdn: the DDTree-verify gated delta rule (each node from its parent's state), with
  `tree_gdn_reference`.
repack: Q4_K / Q6_K weights as separate planes (codes, high bits, scales, f16 block scales) for
  wide / TMA loads, made at load; exact (`to_gguf` rebuilds the bytes, `dequantize_planes` is
  bit-identical to gguf-py).
"""

from pallas_kernels import dequant_matmul, repack, tree_gdn  # modules (their functions share the names)

__all__ = ["dequant_matmul", "repack", "tree_gdn"]
