"""Server load benchmark: N concurrent streaming clients against `python -m dflash_jax.serve` on
127.0.0.1 (a subprocess, started and stopped here), vs the same requests served one at a time.

  python scripts/bench_serve.py --clients 1,4,8,16 --requests_per_client 2 --max_tokens 64 \
      --json_out bench_out/serve_cpu/load.json

Each client sends its requests one after another (a closed loop), streaming chat completions
with greedy decoding. Per level N: aggregate completion tok/s (all tokens / wall time of the
level), p50 / p95 time to first token (request sent -> first content chunk, queueing and prefill
included) and per-token latency ((last chunk - first chunk) / (tokens - 1)). The baseline is the
same N x requests_per_client requests sent one at a time by one client. Prints a table and JSON.
"""

import concurrent.futures
import http.client
import json
import os
import subprocess
import sys
import time

from absl import app, flags

from dflash_jax import cli

_CLIENTS = flags.DEFINE_list("clients", ["1", "4", "8", "16"], "Concurrent client counts.")
_PER_CLIENT = flags.DEFINE_integer("requests_per_client", 2, "Requests each client sends.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "max_tokens of every request.")
_MAX_BATCH = flags.DEFINE_integer("max_batch", 8, "The server's --max_batch.")
_MODE = flags.DEFINE_string("mode", "auto", "The server's --mode.")
_MAX_CTX = flags.DEFINE_integer("max_ctx", 1024, "The server's --max_ctx.")
_SERVER_ARGS = flags.DEFINE_list("server_args", [], "Extra server flags (e.g. --target=x.gguf).")
_JSON = flags.DEFINE_string("json_out", None, "Write results JSON here.")
_SERVER_LOG = flags.DEFINE_string("server_log", "/tmp/dflash_bench_serve.log", "The server's output.")

PROMPTS = cli.CHAT_PROMPTS           # 16 different prompts


def start_server(port: int) -> subprocess.Popen:
  return cli.start_server([f"--max_batch={_MAX_BATCH.value}", f"--mode={_MODE.value}",
                           f"--max_ctx={_MAX_CTX.value}", "--max_queue=256", *_SERVER_ARGS.value],
                          port, _SERVER_LOG.value)


def one_request(port: int, prompt: str) -> dict:
  """Stream one chat completion; times of the send, first and last content chunk, tokens."""
  body = json.dumps({"messages": [{"role": "user", "content": prompt}], "stream": True,
                     "max_tokens": _MAX_TOKENS.value, "temperature": 0,
                     "stream_options": {"include_usage": True}})
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
  t0 = time.perf_counter()
  conn.request("POST", "/v1/chat/completions", body=body,
               headers={"content-type": "application/json"})
  resp = conn.getresponse()
  first = last = None
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
    if ev.get("usage"):
      n_tok = ev["usage"]["completion_tokens"]
  conn.close()
  end = time.perf_counter()
  first = first or end
  return {"ttft_s": first - t0, "tokens": n_tok, "end": end, "start": t0,
          "per_token_s": ((last or end) - first) / (n_tok - 1) if n_tok > 1 else None}


def run_level(port: int, n_clients: int, per_client: int, offset: int = 0) -> dict:
  def client(i):
    return [one_request(port, PROMPTS[(offset + i * per_client + j) % len(PROMPTS)])
            for j in range(per_client)]

  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(n_clients) as ex:
    reqs = [r for rs in ex.map(client, range(n_clients)) for r in rs]
  wall = time.perf_counter() - t0
  ttft = sorted(r["ttft_s"] for r in reqs)
  ptl = sorted(r["per_token_s"] for r in reqs if r["per_token_s"] is not None)
  q = lambda xs, p: xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))] if xs else None
  return {"clients": n_clients, "requests": len(reqs), "tokens": sum(r["tokens"] for r in reqs),
          "wall_s": wall, "aggregate_tok_s": sum(r["tokens"] for r in reqs) / wall,
          "ttft_p50_s": q(ttft, 0.5), "ttft_p95_s": q(ttft, 0.95),
          "per_token_p50_s": q(ptl, 0.5), "per_token_p95_s": q(ptl, 0.95)}


def metrics(port: int) -> dict:
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
  conn.request("GET", "/metrics")
  text = conn.getresponse().read().decode()
  conn.close()
  from dflash_jax import serve_metrics
  return serve_metrics.parse(text)


def main(argv):
  del argv
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
    m = metrics(port)
  finally:
    proc.terminate()
    proc.wait(timeout=60)
  one = rows[0]["concurrent"]["aggregate_tok_s"] if rows and rows[0]["clients"] == 1 else None
  print(f"{'N':>3}{'agg tok/s':>11}{'x seq':>7}{'x N=1':>7}{'TTFT p50':>10}{'p95':>8}"
        f"{'tok lat p50':>13}{'p95':>8}{'seq tok/s':>11}")
  for r in rows:
    c = r["concurrent"]
    print(f"{r['clients']:>3}{c['aggregate_tok_s']:>11.2f}{r['speedup']:>7.2f}"
          f"{(c['aggregate_tok_s'] / one if one else float('nan')):>7.2f}{c['ttft_p50_s']:>10.2f}"
          f"{c['ttft_p95_s']:>8.2f}{1000 * (c['per_token_p50_s'] or 0):>11.1f}ms"
          f"{1000 * (c['per_token_p95_s'] or 0):>6.0f}ms{r['one_at_a_time']['aggregate_tok_s']:>11.2f}")
  result = {"mode": _MODE.value, "max_batch": _MAX_BATCH.value, "max_tokens": _MAX_TOKENS.value,
            "requests_per_client": _PER_CLIENT.value, "levels": rows, "server_metrics": m,
            "cpu_count": os.cpu_count(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
  if _JSON.value:
    os.makedirs(os.path.dirname(os.path.abspath(_JSON.value)), exist_ok=True)
    with open(_JSON.value, "w") as fh:
      json.dump(result, fh, indent=1)


if __name__ == "__main__":
  app.run(main)
