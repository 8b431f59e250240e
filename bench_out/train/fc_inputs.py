"""Issue 24 (session 32): the shipped draft's fc input (target features of layers 1/10/18/27): per-channel
RMS outliers, and how much of fc's output energy the outlier channels and each layer carry, on 4
held-out sequences (the last shards). Checks whether feature outliers starve the other channels.

    PYTHONPATH=. python bench_out/train/fc_inputs.py
"""
import numpy as np, jax.numpy as jnp
import dflash_jax as dj
from dflash_jax import cli, draft_io, target as target_lib
from dflash_jax.quants import dequantize
from dflash_jax.train import shards
t = dj.load_target(cli.default_target_path(), tokenizer=False)
cfg, p = draft_io.load("checkpoints/smollm2-135m-instruct-dflash", t.config)
W = np.asarray(dequantize(p.fc, jnp.float32))   # [576, 2304]
seqs = shards.read_shards("checkpoints/train_data/smollm2-135m-instruct", 49152)[-8:]
F = []
for s in seqs[:4]:
  toks = np.concatenate([s.prompt, s.response])[:400].astype(np.int32)
  out = target_lib.prefill(t.params, t.config, jnp.asarray(toks), jnp.int32(0), jnp.int32(len(toks)),
                           target_lib.init_cache(t.config, 512, t.runtime), t.runtime, feature_layers=cfg.target_layer_ids)
  F.append(np.asarray(out.feats)[1:])
F = np.concatenate(F).astype(np.float64)
rms = np.sqrt((F**2).mean(0))
order = np.argsort(-rms)
y = F @ W.T.astype(np.float64)
tot = (y**2).sum()
for k in (1, 2, 5, 10, 20):
  idx = order[:k]
  yk = F[:, idx] @ W[:, idx].T
  print(f"top-{k} input channels (rms {rms[idx].min():.1f}+): share of fc output energy {(yk**2).sum()/tot:.3f}; their weight col-norms mean {np.linalg.norm(W[:, idx], axis=0).mean():.4f}")
print("median col-norm", np.median(np.linalg.norm(W, axis=0)))
# per-layer contribution
for j in range(4):
  sl = slice(j*576, (j+1)*576)
  yj = F[:, sl] @ W[:, sl].T
  print("layer", cfg.target_layer_ids[j], "share of fc output energy", round((yj**2).sum()/tot, 3), "feature rms", round(np.sqrt((F[:, sl]**2).mean()), 2))
# random-direction test: fc output variance explained by the per-position mean (constant) component
print("fraction of fc output energy in its mean over positions:", ((y.mean(0)**2).sum()*len(y))/tot)
