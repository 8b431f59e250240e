"""Server benchmark against `python -m dflash_jax.serve` on 127.0.0.1 (subprocesses started and
stopped here). Scenarios (--scenarios):

  startup  start to ready (/health 200) and to every batch bucket warm, cold (an empty compile
           cache) and warm (the same cache again); each start is followed at once by a burst of 8
           concurrent requests. Memory by component (/metrics) after ready and after a mixed load
           (short, 900-word, sampled and JSON-schema requests at once).
  ttft     time to first token seen by the client (request sent -> first content chunk) against
           the server's own figure (`dflash.time_to_first_token_s` of the last chunk), for short
           and 900-word prompts, one at a time and at 8 concurrent clients.
  load     N concurrent streaming clients (a closed loop) vs the same requests one at a time:
           aggregate tok/s, TTFT and per-token latency per level.

  python scripts/bench_serve.py --scenarios startup,ttft --json_out bench_out/cpu/serve.json
  python scripts/bench_serve.py --scenarios load --clients 1,4,8,16 --requests_per_client 2

Greedy streaming chat completions unless said. Prints tables and writes JSON (with the machine and
the command).
"""

import concurrent.futures
import http.client
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from dflash_jax import cli

_SCENARIOS = flags.DEFINE_list("scenarios", ["startup", "ttft"], "Which of startup, ttft, load.")
_CLIENTS = flags.DEFINE_list("clients", ["1", "4", "8", "16"], "Concurrent client counts (load).")
_BURST = flags.DEFINE_integer("burst", 8, "Concurrent requests of the burst after ready, and "
                              "clients of the concurrent TTFT runs.")
_TTFT_REQUESTS = flags.DEFINE_integer("ttft_requests", 8, "Requests per TTFT run (one at a time, "
                                      "or one per concurrent client).")
_LONG_WORDS = flags.DEFINE_integer("long_words", 900, "Words of the long prompt.")
_PER_CLIENT = flags.DEFINE_integer("requests_per_client", 2, "Requests each client sends.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "max_tokens of every request.")
_MAX_BATCH = flags.DEFINE_integer("max_batch", 8, "The server's --max_batch.")
_MODE = flags.DEFINE_string("mode", "auto", "The server's --mode.")
_MAX_CTX = flags.DEFINE_integer("max_ctx", 2048, "The server's --max_ctx.")
_SERVER_ARGS = flags.DEFINE_list("server_args", [], "Extra server flags (e.g. --target=x.gguf).")
_JSON = flags.DEFINE_string("json_out", None, "Write results JSON here.")
_SERVER_LOG = flags.DEFINE_string("server_log", "/tmp/dflash_bench_serve.log", "The server's output.")

PROMPTS = cli.CHAT_PROMPTS           # 16 different prompts


def long_prompt(i: int, words: int) -> str:
  """A prompt of about `words` words, different from the first words on for each i (so that the
  prompt cache restores only the chat template's shared prefix)."""
  text = " ".join(PROMPTS).split()
  body = " ".join(text[(i * 7 + j) % len(text)] for j in range(words))
  return f"Notes {i}: {body}\n\nSummarize these notes in one sentence."


def server_args(extra=()) -> list:
  return [f"--max_batch={_MAX_BATCH.value}", f"--mode={_MODE.value}", f"--max_ctx={_MAX_CTX.value}",
          "--max_queue=256", *_SERVER_ARGS.value, *extra]


def start_server(port: int) -> subprocess.Popen:
  return cli.start_server(server_args(), port, _SERVER_LOG.value)


def start_timed(port: int, extra=()) -> tuple[subprocess.Popen, float, float]:
  """Start a server; (process, seconds from the start to /health 200, perf_counter at the start)."""
  cmd = [sys.executable, "-m", "dflash_jax.serve", f"--port={port}", *server_args(extra)]
  t0 = time.perf_counter()
  proc = subprocess.Popen(cmd, stdout=open(_SERVER_LOG.value, "a"), stderr=subprocess.STDOUT)
  cli.wait_for_server(proc, port, _SERVER_LOG.value, all_warm=False)
  return proc, time.perf_counter() - t0, t0


def one_request(port: int, prompt: str, extra: dict | None = None) -> dict:
  """Stream one chat completion; times of the send, first and last content chunk, tokens, and the
  server's time to first token."""
  body = json.dumps({"messages": [{"role": "user", "content": prompt}], "stream": True,
                     "max_tokens": _MAX_TOKENS.value, "temperature": 0,
                     "stream_options": {"include_usage": True}, **(extra or {})})
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
  t0 = time.perf_counter()
  conn.request("POST", "/v1/chat/completions", body=body,
               headers={"content-type": "application/json"})
  resp = conn.getresponse()
  first = last = server_ttft = None
  n_tok = 0
  for raw in resp:
    line = raw.decode().strip()
    if not line.startswith("data: ") or line == "data: [DONE]":
      continue
    ev = json.loads(line[6:])
    if "error" in ev:
      raise RuntimeError(ev["error"])
    if any((c.get("delta") or {}).get("content") for c in ev.get("choices", [])):
      last = time.perf_counter()
      first = first or last
    if ev.get("dflash"):                       # the choice's last chunk
      server_ttft = ev["dflash"].get("time_to_first_token_s")
    if ev.get("usage"):
      n_tok = ev["usage"]["completion_tokens"]
  conn.close()
  end = time.perf_counter()
  first = first or end
  return {"ttft_s": first - t0, "server_ttft_s": server_ttft, "tokens": n_tok, "end": end,
          "start": t0,
          "per_token_s": ((last or end) - first) / (n_tok - 1) if n_tok > 1 else None}


def _q(xs, p):
  xs = sorted(x for x in xs if x is not None)
  return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))] if xs else None


def run_requests(port: int, prompts: list, clients: int, extras=None) -> dict:
  """Send `prompts` from `clients` threads (a closed loop: each takes the next prompt when its last
  finished): wall time, aggregate tok/s, TTFT p50 / p95 as the client and the server see it, and
  per-token latency p50 / p95."""
  extras = extras or [None] * len(prompts)
  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(clients) as ex:
    reqs = list(ex.map(lambda pe: one_request(port, *pe), zip(prompts, extras)))
  wall = time.perf_counter() - t0
  ttft = [r["ttft_s"] for r in reqs]
  srv = [r["server_ttft_s"] for r in reqs]
  ptl = [r["per_token_s"] for r in reqs]
  tokens = sum(r["tokens"] for r in reqs)
  return {"clients": clients, "requests": len(reqs), "wall_s": wall, "tokens": tokens,
          "aggregate_tok_s": tokens / wall,
          "ttft_p50_s": _q(ttft, 0.5), "ttft_p95_s": _q(ttft, 0.95),
          "server_ttft_p50_s": _q(srv, 0.5), "server_ttft_p95_s": _q(srv, 0.95),
          "client_minus_server_ms_p50": 1e3 * _q([a - b for a, b in zip(ttft, srv)
                                                  if b is not None], 0.5)
          if any(b is not None for b in srv) else None,
          "per_token_p50_s": _q(ptl, 0.5), "per_token_p95_s": _q(ptl, 0.95)}


def run_level(port: int, n_clients: int, per_client: int) -> dict:
  """n_clients x per_client chat prompts (PROMPTS in turn) from n_clients closed-loop clients."""
  n = n_clients * per_client
  return run_requests(port, [PROMPTS[k % len(PROMPTS)] for k in range(n)], n_clients)


def metrics_text(port: int) -> str:
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
  conn.request("GET", "/metrics")
  text = conn.getresponse().read().decode()
  conn.close()
  return text


def metrics(port: int) -> dict:
  from dflash_jax import serve_metrics
  return serve_metrics.parse(metrics_text(port))


def memory(port: int) -> dict:
  """{component: bytes} from /metrics (dflash_memory_bytes) plus the process's RSS and `other`:
  RSS less the components (the runtime, compiled programs, Python, the tokenizer)."""
  from prometheus_client.parser import text_string_to_metric_families
  fams = {f.name: f for f in text_string_to_metric_families(metrics_text(port))}
  mem = {smp.labels["component"]: int(smp.value) for smp in fams["dflash_memory_bytes"].samples}
  rss = int(fams["process_resident_memory_bytes"].samples[0].value)
  mem["other"] = rss - sum(mem.values())
  mem["rss"] = rss
  return mem


def mixed_load(port: int) -> dict:
  """Short, 900-word, sampled and JSON-schema requests at once, one per client."""
  schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
      "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}
  prompts = [PROMPTS[0], long_prompt(100, _LONG_WORDS.value), PROMPTS[1], PROMPTS[2]] * 2
  extras = [None, None, {"temperature": 0.8, "seed": 1}, {"response_format": schema}] * 2
  return run_requests(port, prompts, len(prompts), extras)


def stop(proc: subprocess.Popen) -> None:
  proc.terminate()
  proc.wait(timeout=120)


def scenario_startup() -> dict:
  """Cold and warm start to ready and to all buckets warm, each followed by a burst."""
  cache = tempfile.mkdtemp(prefix="dflash_bench_serve_cache_")
  out = {}
  try:
    for phase in ("cold", "warm"):
      port = cli.free_port()
      proc, ready_s, t0 = start_timed(port, [f"--compile_cache_dir={cache}"])
      try:
        mem_ready = memory(port)
        burst = run_requests(port, PROMPTS[:_BURST.value], _BURST.value)
        cli.wait_for_server(proc, port, _SERVER_LOG.value)            # every bucket warm
        all_warm_s = time.perf_counter() - t0
        row = {"ready_s": ready_s, "all_buckets_warm_s": all_warm_s, "burst": burst,
               "memory_after_ready": mem_ready}
        if phase == "warm":
          row["mixed_load"] = mixed_load(port)
          row["memory_after_mixed_load"] = memory(port)
      finally:
        stop(proc)
      out[phase] = row
      print(json.dumps({phase: row}), file=sys.stderr)
  finally:
    shutil.rmtree(cache, ignore_errors=True)
  return out


def scenario_ttft() -> dict:
  port = cli.free_port()
  proc = start_server(port)
  out = {}
  try:
    one_request(port, "Hi")
    n, c = _TTFT_REQUESTS.value, _BURST.value
    for name, make in (("short", lambda i: PROMPTS[i % len(PROMPTS)]),
                       ("long", lambda i: long_prompt(i, _LONG_WORDS.value))):
      for label, clients, base in (("alone", 1, 0), ("concurrent", c, n)):
        r = run_requests(port, [make(base + i) for i in range(n)], clients)
        out[f"{name}_{label}"] = r
        print(json.dumps({f"{name}_{label}": r}), file=sys.stderr)
  finally:
    stop(proc)
  return out


def scenario_load() -> list:
  port = cli.free_port()
  proc = start_server(port)
  try:
    one_request(port, "Hi")                    # first request: nothing left to compile
    rows = []
    for n in (int(c) for c in _CLIENTS.value):
      seq = run_level(port, 1, n * _PER_CLIENT.value)          # the same requests, one at a time
      conc = run_level(port, n, _PER_CLIENT.value)
      row = {"clients": n, "concurrent": conc, "one_at_a_time": seq,
             "speedup": conc["aggregate_tok_s"] / seq["aggregate_tok_s"]}
      rows.append(row)
      print(json.dumps(row), file=sys.stderr)
    rows[-1]["server_metrics"] = metrics(port)
  finally:
    stop(proc)
  one = rows[0]["concurrent"]["aggregate_tok_s"] if rows and rows[0]["clients"] == 1 else None
  print(f"{'N':>3}{'agg tok/s':>11}{'x seq':>7}{'x N=1':>7}{'TTFT p50':>10}{'p95':>8}"
        f"{'tok lat p50':>13}{'p95':>8}{'seq tok/s':>11}")
  for r in rows:
    c = r["concurrent"]
    print(f"{r['clients']:>3}{c['aggregate_tok_s']:>11.2f}{r['speedup']:>7.2f}"
          f"{(c['aggregate_tok_s'] / one if one else float('nan')):>7.2f}{c['ttft_p50_s']:>10.2f}"
          f"{c['ttft_p95_s']:>8.2f}{1000 * (c['per_token_p50_s'] or 0):>11.1f}ms"
          f"{1000 * (c['per_token_p95_s'] or 0):>6.0f}ms{r['one_at_a_time']['aggregate_tok_s']:>11.2f}")
  return rows


def machine() -> str:
  """CPU model, cores and memory of this machine, and its accelerator if JAX sees one."""
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as fh:
      cpu = next(l.split(":", 1)[1].strip() for l in fh if l.startswith("model name"))
  except (OSError, StopIteration):
    pass
  mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
  return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB"


def _mib(n) -> str:
  return f"{n / 2**20:8.1f}"


def print_tables(res: dict) -> None:
  st = res.get("startup")
  if st:
    print(f"{'start':<6}{'ready s':>9}{'all warm s':>12}{'burst TTFT p50':>16}{'p95':>8}{'burst s':>9}")
    for phase, r in st.items():
      b = r["burst"]
      print(f"{phase:<6}{r['ready_s']:>9.1f}{r['all_buckets_warm_s']:>12.1f}"
            f"{b['ttft_p50_s']:>16.2f}{b['ttft_p95_s']:>8.2f}{b['wall_s']:>9.1f}")
    w = st.get("warm", {})
    if "memory_after_mixed_load" in w:
      print(f"\n{'component':<16}{'ready MiB':>10}{'mixed MiB':>10}")
      for k in w["memory_after_ready"]:
        print(f"{k:<16}{_mib(w['memory_after_ready'][k]):>10}{_mib(w['memory_after_mixed_load'][k]):>10}")
  tt = res.get("ttft")
  if tt:
    print(f"\n{'prompt':<20}{'clients':>8}{'TTFT p50':>10}{'p95':>8}{'server p50':>12}{'p95':>8}"
          f"{'client-server ms':>18}")
    for k, r in tt.items():
      print(f"{k:<20}{r['clients']:>8}{r['ttft_p50_s']:>10.2f}{r['ttft_p95_s']:>8.2f}"
            f"{r['server_ttft_p50_s']:>12.2f}{r['server_ttft_p95_s']:>8.2f}"
            f"{r['client_minus_server_ms_p50']:>18.1f}")


def main(argv):
  del argv
  res = {}
  for sc in _SCENARIOS.value:
    fn = {"startup": scenario_startup, "ttft": scenario_ttft, "load": scenario_load}.get(sc)
    if fn is None:
      raise app.UsageError(f"--scenarios: unknown scenario {sc!r} (startup, ttft, load)")
    res[sc] = fn()
  print_tables(res)
  result = {"scenarios": res, "mode": _MODE.value, "max_batch": _MAX_BATCH.value,
            "max_ctx": _MAX_CTX.value, "max_tokens": _MAX_TOKENS.value,
            "requests_per_client": _PER_CLIENT.value, "server_args": _SERVER_ARGS.value,
            "machine": machine(),
            "command": "python " + " ".join(sys.argv),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
  if _JSON.value:
    os.makedirs(os.path.dirname(os.path.abspath(_JSON.value)), exist_ok=True)
    with open(_JSON.value, "w") as fh:
      json.dump(result, fh, indent=1)


if __name__ == "__main__":
  app.run(main)
