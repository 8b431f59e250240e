"""JAX's persistent compilation cache, on by default for the scripts and the server: a program
compiled once (the decode loop, prefill chunks, warm-up of every batch bucket) is read back from
disk by the next process instead of compiled again (on this 2-core CPU: generate.py's compile
34 s -> ~7 s, the server's warm-up ~150 s -> ~50 s).

The directory defaults to $XDG_CACHE_HOME/dflash_jax/xla (~/.cache/dflash_jax/xla); the scripts'
--compile_cache_dir moves it and --nocompile_cache turns it off. Library users call `enable()`
themselves (importing dflash_jax changes no global JAX setting). A corrupt or unreadable entry is
JAX's business: it warns ("Error reading persistent compilation cache entry") and compiles again.
"""

from __future__ import annotations

import os
from typing import Optional

import jax


def user_cache_dir(name: str) -> str:
  """$XDG_CACHE_HOME/dflash_jax/<name>, or ~/.cache/dflash_jax/<name>: where this package keeps
  what it can rebuild (compiled programs, built n-gram tables)."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "dflash_jax", name)


def default_dir() -> str:
  """$XDG_CACHE_HOME/dflash_jax/xla, or ~/.cache/dflash_jax/xla."""
  return user_cache_dir("xla")


def enable(cache_dir: Optional[str] = None) -> str:
  """Use a persistent compilation cache in `cache_dir` (default `default_dir()`), created if
  missing, for every program however small or quick to compile (JAX's default thresholds skip
  programs compiled in under a second). Call before the first compilation it should cover.
  Returns the directory. Raises ValueError naming the directory when it cannot be created or
  written."""
  d = os.path.abspath(os.path.expanduser(cache_dir or default_dir()))
  try:
    os.makedirs(d, exist_ok=True)
    if not os.access(d, os.W_OK):
      raise PermissionError("not writable")
  except OSError as e:
    raise ValueError(f"compile cache directory {d}: {e}") from None
  jax.config.update("jax_compilation_cache_dir", d)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return d


def disable():
  """No persistent compilation cache (every process compiles for itself)."""
  jax.config.update("jax_compilation_cache_dir", None)
