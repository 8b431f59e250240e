"""Where the server engine's time goes under N closed-loop clients (in process, no HTTP): python engine_profile.py N [steps_per_call]."""
import time, threading, collections, sys
import jax
import dflash_jax as dj
from dflash_jax import cli, serve, batching
t = dj.load_target(cli.default_target_path())
d = dj.load_draft(cli.find_draft_dir(t), t)
dec = dj.api.resolve_config(d, mode="ar", max_ctx=1024)
N = int(sys.argv[1]); spc = int(sys.argv[2]) if len(sys.argv) > 2 else 4
eng = serve.Engine(t, None, dec, None, "smol", max_queue=64, max_batch=8, steps_per_call=spc)
eng.warm_up()
T = collections.defaultdict(float); C = collections.Counter()
def wrap(cls, name):
  f = getattr(cls, name)
  def g(self, *a, **k):
    t0 = time.perf_counter(); r = f(self, *a, **k)
    if name == "run": jax.block_until_ready(self.state.pos)
    T[name] += time.perf_counter() - t0; C[name] += 1; return r
  setattr(cls, name, g)
for n in ["run", "progress", "new_tokens", "row", "finite"]: wrap(batching.SlotBatch, n)
orig = batching.SlotBatch.prefill_chunks
def pc(self, *a, **k):
  for x in orig(self, *a, **k):
    yield x
batching.SlotBatch.prefill_chunks = pc
import dflash_jax.decode as dl
f0 = dl.prefill_chunk
def pf(*a, **k):
  t0 = time.perf_counter(); r = f0(*a, **k); jax.block_until_ready(r.pos); T["prefill"] += time.perf_counter()-t0; C["prefill"] += 1; return r
batching.decode_lib.prefill_chunk = pf
P = [cli.build_prompt(t, x, chat=True) for x in cli.CHAT_PROMPTS]
toks = [0]
def client(i):
  for j in range(2):
    out = eng.submit(P[(i*2+j) % 16], 48, [], dj.SamplingConfig(), lambda s: None, lambda: False).result()
    toks[0] += out.completion_tokens
t0 = time.perf_counter()
th = [threading.Thread(target=client, args=(i,)) for i in range(N)]
[x.start() for x in th]; [x.join() for x in th]
wall = time.perf_counter() - t0
print("N", N, "wall", round(wall,2), "tok", toks[0], "tok/s", round(toks[0]/wall,1))
for k in T: print(f"  {k:12s} {T[k]:7.2f}s  n={C[k]}  per={1000*T[k]/C[k]:.1f}ms")
print(eng.metrics)
