"""Child process of test_gguf_fuzz.py: loads every mutated GGUF under an address-space limit and
a per-case alarm, and prints one JSON line per case:
  {"case", "outcome": "error" | "same" | "changed" | "nonfinite" | "bad", "msg", "s"}
"same": loaded, config equal to the original's, logits equal; "changed": loaded, config differs,
logits finite; "nonfinite": generate() refused non-finite logits; "error": a ValueError /
NotImplementedError (the message is checked by the parent); "bad": anything else.
Usage: python gguf_fuzz_child.py SRC N_CASES SEED WORKDIR MEM_LIMIT_BYTES ALARM_S
"""

import json
import os
import resource
import signal
import sys
import time

import numpy as np


def main(src, n_cases, seed, workdir, mem_limit, alarm_s):
  resource.setrlimit(resource.RLIMIT_AS, (mem_limit, mem_limit))
  import jax
  jax.config.update("jax_platforms", "cpu")
  import dflash_jax as dj
  import gguf_mutations

  def on_alarm(*_):
    raise TimeoutError(f"case took more than {alarm_s} s")
  signal.signal(signal.SIGALRM, on_alarm)
  prompt = [1, 2, 3, 4, 5]
  orig = dj.load_target(src)
  ref = dj.forward_logits(orig, prompt)
  path = os.path.join(workdir, "mutated.gguf")
  for name, data in gguf_mutations.mutations(src, n_cases, seed):
    with open(path, "wb") as fh:
      fh.write(data)
    t0 = time.perf_counter()
    signal.alarm(alarm_s)
    try:
      tgt = dj.load_target(path)
      logits = dj.forward_logits(tgt, prompt)
      if tgt.config == orig.config and np.array_equal(logits, ref):
        out, msg = "same", ""
      elif tgt.config != orig.config and np.isfinite(logits).all():
        out, msg = "changed", ""
      else:
        try:
          dj.generate(tgt, None, prompt, max_new_tokens=1, mode="ar", max_ctx=16, prefill_chunk=8)
          out, msg = "bad", f"loaded with config equal={tgt.config == orig.config}, logits differ"
        except ValueError as e:
          out, msg = ("nonfinite" if "not finite" in str(e) else "bad"), str(e)
    except (ValueError, NotImplementedError) as e:
      out, msg = "error", str(e)
    except BaseException as e:  # noqa: BLE001 - every other failure is what the test looks for
      out, msg = "bad", f"{type(e).__name__}: {e}"
    finally:
      signal.alarm(0)
    print(json.dumps({"case": name, "outcome": out, "msg": msg[:300],
                      "s": round(time.perf_counter() - t0, 3)}), flush=True)
  print(json.dumps({"maxrss_kb": _peak_rss_kb()}), flush=True)


def _peak_rss_kb() -> int:
  """This process's own peak resident set (kB): VmHWM of its address space. getrusage's ru_maxrss
  is not that on Linux: it keeps the high-water mark of the parent's image across fork + exec,
  so a child of a large pytest process reported the parent's peak."""
  try:
    with open("/proc/self/status") as fh:
      for line in fh:
        if line.startswith("VmHWM:"):
          return int(line.split()[1])
  except OSError:
    pass
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


if __name__ == "__main__":
  a = sys.argv[1:]
  main(a[0], int(a[1]), int(a[2]), a[3], int(a[4]), int(a[5]))
