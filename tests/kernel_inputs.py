"""Random inputs for the kernel tests (kept out of the library)."""

import numpy as np


def tree_gdn_inputs(rng, n: int, hv: int, dk: int, dv: int):
  """Valid random tree-GDN inputs for the tests (numpy float32): q, k L2-normalized (q also
  scaled by Dk**-0.5), v ~ N(0, 1), g = -|N(0, 1)| * 0.3 (log decay), beta ~ U(0, 1),
  state ~ N(0, 0.04). rng: numpy Generator. Returns (q, k, v, g, beta, state) shaped as
  `tree_gdn_reference` takes them."""
  q = rng.standard_normal((n, hv, dk)).astype(np.float32)
  q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(dk)
  k = rng.standard_normal((n, hv, dk)).astype(np.float32)
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  v = rng.standard_normal((n, hv, dv)).astype(np.float32)
  g = (-np.abs(rng.standard_normal((n, hv))) * 0.3).astype(np.float32)
  beta = rng.uniform(0, 1, (n, hv)).astype(np.float32)
  state = (rng.standard_normal((hv, dk, dv)) * 0.2).astype(np.float32)
  return q, k, v, g, beta, state


def root_path(parents, i: int) -> list[int]:
  """Node i's root path in a tree given by parents (-1 = root), root first."""
  path, j = [], i
  while j >= 0:
    path.append(j)
    j = int(parents[j])
  return path[::-1]
