"""Rows per attention_live chunk vs the target's verify step at long context (session 20): SmolLM2
(default target), a cache of live + 64 rows, the verify forward of T tokens (1: AR, 16: chain),
median of 3 after compiling, per KV format, chunk size and live length. Each chunk is one
fori_loop iteration with a fixed cost, so long caches want fewer, larger chunks
(layers.live_chunk picks capacity / 32 within 128..2048).

  python bench_out/kv_cpu/attention_chunk.py float32,q8_0 128,512,2048 1024,16384,65536 1,16 \
      > bench_out/kv_cpu/attention_chunk.json
"""

import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import dflash_jax as dj
from dflash_jax import cli, layers
from dflash_jax import target as target_lib
from dflash_jax import tree as tree_lib
from dflash_jax.runtime import Runtime


def main(fmts, chunks, ctxs, ns):
  orig = layers.attention_live
  t = dj.load_target(cli.default_target_path())
  rows = []
  for f in fmts:
    rt = Runtime(kv_dtype=f)
    for ch in chunks:
      layers.attention_live = functools.partial(orig, chunk=ch)

      @functools.partial(jax.jit, static_argnames=("n",))
      def verify(params, cache, start, *, n):
        tree = tree_lib.path_tree(jnp.zeros((n,), jnp.int32))
        return target_lib.verify(params, t.config, tree, start, cache, rt).logits

      for n in ns:
        for ctx in ctxs:
          cache = target_lib.init_cache(t.config, ctx + 64, rt)
          verify(t.params, cache, jnp.int32(ctx), n=n).block_until_ready()
          ts = []
          for _ in range(3):
            t0 = time.perf_counter()
            verify(t.params, cache, jnp.int32(ctx), n=n).block_until_ready()
            ts.append(time.perf_counter() - t0)
          rows.append(dict(format=f, chunk=ch, tokens=n, live=ctx,
                           ms=1e3 * statistics.median(ts)))
          print(rows[-1], file=sys.stderr, flush=True)
          del cache
  layers.attention_live = orig
  print(json.dumps(dict(target=t.path, device=str(jax.devices()[0]), rows=rows), indent=1))


if __name__ == "__main__":
  a = sys.argv[1:]
  main(a[0].split(","), [int(x) for x in a[1].split(",")], [int(x) for x in a[2].split(",")],
       [int(x) for x in a[3].split(",")])
