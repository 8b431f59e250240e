"""The OpenAI-compatible server over real HTTP on loopback, driven by the official `openai` client:
outputs equal `generate()` (greedy), streaming, stop strings, max_tokens, usage, 4xx errors that
leave the server serving, a disconnect that frees the server, and a bounded concurrent load."""

import concurrent.futures
import http.client
import json
import socket
import threading
import time
import urllib.parse

import openai
import pytest

import dflash_jax as dj
from dflash_jax import cli, serve

MAX_CTX = 256
PROMPTS = ["What is 2 + 2?", "Name a colour.", "Say hello in French."]


def _start(engine, api_key=None):
  """(base URL, uvicorn server, thread) of the app on a free loopback port."""
  import uvicorn
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  srv = uvicorn.Server(uvicorn.Config(serve.create_app(engine, api_key), host="127.0.0.1",
                                      port=port, log_level="warning"))
  th = threading.Thread(target=srv.run, daemon=True)
  th.start()
  for _ in range(200):
    if srv.started:
      break
    time.sleep(0.05)
  return f"http://127.0.0.1:{port}", srv, th


@pytest.fixture(scope="module")
def server(smol):
  draft = dj.load_draft(cli.find_draft_dir(smol), smol)
  dec = dj.api.resolve_config(draft, dj.DecodeConfig(mode="chain", max_ctx=MAX_CTX))
  engine = serve.Engine(smol, draft, dec, None, "smol", max_queue=64)
  base, srv, th = _start(engine)
  yield base, engine, draft, dec
  srv.should_exit = True
  th.join(timeout=10)


def test_api_key(server):
  base, srv, th = _start(server[1], api_key="k")
  try:
    status, r = _http(base, "GET", "/v1/models")
    assert status == 401 and r["error"]["code"] == "invalid_api_key"
    assert _http(base, "GET", "/health")[0] == 200          # health needs no key
    c = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0, timeout=300)
    assert c.completions.create(model="smol", prompt="1, 2,", max_tokens=2).usage.completion_tokens == 2
  finally:
    srv.should_exit = True
    th.join(timeout=10)


def _http(base, method, path, body=None, raw=None, timeout=300):
  """(status, parsed JSON or text) of one plain HTTP request (stdlib http.client)."""
  u = urllib.parse.urlparse(base)
  conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
  data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
  conn.request(method, path, body=data, headers={"content-type": "application/json"})
  resp = conn.getresponse()
  text = resp.read().decode()
  conn.close()
  try:
    return resp.status, json.loads(text)
  except json.JSONDecodeError:
    return resp.status, text


def _client(base):
  return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)


def _reference(smol, draft, dec, text, max_new):
  ids = cli.build_prompt(smol, text, chat=True)
  r = dj.generate(smol, draft, ids, max_new_tokens=max_new, config=dec)
  return ids, r


def test_chat_equals_generate_streamed_and_not(server, smol):
  base, _, draft, dec = server
  ids, ref = _reference(smol, draft, dec, PROMPTS[0], 12)
  want = smol.tokenizer.decode(ref.tokens)
  c = _client(base)
  msgs = [{"role": "user", "content": PROMPTS[0]}]
  r = c.chat.completions.create(model="smol", messages=msgs, max_tokens=12, temperature=0)
  assert r.choices[0].message.content == want
  assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref.tokens)
  assert r.choices[0].finish_reason == ("stop" if ref.stop_reason == "eog" else "length")
  extra = r.model_extra["dflash"]
  assert extra["mode"] == "chain" and extra["mean_acceptance_length"] >= 1.0
  # the same request again: its slot holds the prompt (all but the last token is reused)
  again = c.chat.completions.create(model="smol", messages=msgs, max_tokens=12, temperature=0)
  assert again.choices[0].message.content == want
  assert again.usage.prompt_tokens_details.cached_tokens == \
      again.model_extra["dflash"]["prompt_tokens_reused"] > 0
  chunks = list(c.chat.completions.create(model="smol", messages=msgs, max_tokens=12,
                                          temperature=0, stream=True,
                                          stream_options={"include_usage": True}))
  text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
  assert text == want
  assert chunks[0].choices[0].delta.role == "assistant"
  assert chunks[-1].choices[0].finish_reason in ("stop", "length")
  assert chunks[-1].usage.completion_tokens == len(ref.tokens)


def test_completions_models_and_max_tokens(server, smol):
  base, _, draft, dec = server
  c = _client(base)
  prompt = "def add(a, b):"
  ids = smol.tokenizer.encode(prompt)
  ref = dj.generate(smol, draft, ids, max_new_tokens=7, config=dec, eog_ids=())
  r = c.completions.create(model="smol", prompt=prompt, max_tokens=7, temperature=0)
  assert r.choices[0].text == smol.tokenizer.decode(ref.tokens)
  assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"
  assert [m.id for m in c.models.list().data] == ["smol"]
  assert _http(base, "GET", "/health")[1]["status"] == "ok"
  assert "dflash_mean_acceptance_length" in _http(base, "GET", "/metrics")[1]


def test_stop_strings_cut_exactly(server, smol):
  base, _, draft, dec = server
  _, ref = _reference(smol, draft, dec, PROMPTS[2], 24)
  full = smol.tokenizer.decode(ref.tokens)
  stop = full[6:9]
  assert stop and full.find(stop) >= 0
  want = full[:full.find(stop)]
  c = _client(base)
  msgs = [{"role": "user", "content": PROMPTS[2]}]
  r = c.chat.completions.create(model="smol", messages=msgs, max_tokens=24, temperature=0,
                                stop=[stop, "@@never@@"])
  assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
  chunks = list(c.chat.completions.create(model="smol", messages=msgs, max_tokens=24,
                                          temperature=0, stop=stop, stream=True))
  assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "word " * 400}]}, "messages"),
    ({"messages": "hello"}, "messages")])
def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, body, param):
  base = server[0]
  status, r = _http(base, "POST", "/v1/chat/completions", body)
  assert status == 400, r
  err = r["error"]
  assert err["message"] and err["param"] and err["param"].startswith(param)
  status, r = _http(base, "POST", "/v1/chat/completions", raw=b"{not json")
  assert status == 400 and "error" in r
  status, r = _http(base, "POST", "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
  assert status == 200 and r["usage"]["completion_tokens"] >= 1


def test_long_prompt_is_context_length_error(server):
  status, r = _http(server[0], "POST", "/v1/completions", {"prompt": "word " * 400, "max_tokens": 2})
  assert status == 400 and r["error"]["code"] == "context_length_exceeded"


def test_disconnect_mid_stream_frees_the_server(server):
  base, engine = server[0], server[1]
  before = engine.metrics["cancelled_total"]
  body = {"messages": [{"role": "user", "content": "Write a long story about the sea."}],
          "max_tokens": 200, "stream": True, "temperature": 0}
  u = urllib.parse.urlparse(base)
  conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
  conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
               headers={"content-type": "application/json"})
  resp = conn.getresponse()
  while True:
    line = resp.readline().decode()
    if line.startswith("data: ") and '"content"' in line:
      break                                       # got text; hang up
  conn.sock.close()
  conn.close()
  t0 = time.perf_counter()
  status, _ = _http(base, "POST", "/v1/completions", {"prompt": "1, 2, 3,", "max_tokens": 3})
  assert status == 200
  for _ in range(100):
    if engine.metrics["cancelled_total"] > before:
      break
    time.sleep(0.1)
  assert engine.metrics["cancelled_total"] == before + 1
  assert time.perf_counter() - t0 < 60   # the 200-token story did not run to its end first


def test_concurrent_clients_all_complete(server, smol):
  base, _, draft, dec = server
  want = {p: smol.tokenizer.decode(_reference(smol, draft, dec, p, 4)[1].tokens) for p in PROMPTS}
  c = _client(base)

  def client(i):
    out = []
    for j in range(2):
      p = PROMPTS[(i + j) % len(PROMPTS)]
      r = c.chat.completions.create(model="smol", messages=[{"role": "user", "content": p}],
                                    max_tokens=4, temperature=0)
      out.append(r.choices[0].message.content == want[p])
    return out

  with concurrent.futures.ThreadPoolExecutor(20) as ex:
    results = list(ex.map(client, range(20)))
  assert all(all(r) for r in results) and sum(len(r) for r in results) == 40
  assert _http(base, "GET", "/health")[1]["waiting"] == 0


def test_health_loading_then_ready(server):
  """The app answers while the model loads: /health 503 {"status": "loading"}, /v1 routes a 503
  OpenAI-shaped error; once the engine is there, 200 and normal answers."""
  holder = {}
  base, srv, th = _start(lambda: holder.get("engine"))
  try:
    status, r = _http(base, "GET", "/health")
    assert status == 503 and r == {"status": "loading"}
    status, r = _http(base, "GET", "/v1/models")
    assert status == 503 and r["error"]["code"] == "model_loading"
    holder["engine"] = server[1]
    status, r = _http(base, "GET", "/health")
    assert status == 200 and r["status"] == "ok"
    assert _http(base, "GET", "/v1/models")[0] == 200
  finally:
    srv.should_exit = True
    th.join(timeout=10)


def test_serve_module_defines_no_flags_and_help_lists_them():
  """Importing dflash_jax.serve defines no absl flags (a script may define the shared ones);
  `python -m dflash_jax.serve --help` lists the model, decoding, sampling and server flags."""
  import os
  import subprocess
  import sys
  code = ("import dflash_jax.serve\nfrom absl import flags\nassert 'port' not in flags.FLAGS\n"
          "from dflash_jax import decode_flags, target_flags\n"
          "decode_flags.define(); target_flags.define(); print('OK')")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-2000:]
  r = subprocess.run([sys.executable, "-m", "dflash_jax.serve", "--help"], capture_output=True,
                     text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert "Traceback" not in r.stderr, r.stderr[-2000:]       # (absl's --help exits with 1)
  for flag in ("--target", "--mode", "--temperature", "--port", "--max_batch", "--compile_cache_dir"):
    assert f"  {flag}" in r.stdout, flag
