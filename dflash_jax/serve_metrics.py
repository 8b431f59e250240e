"""The server's /metrics in Prometheus text format (prometheus_client, one registry per Engine):
counters and gauges read from the engine at scrape time, histograms of request latency and time
to first token observed as requests finish."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_SECONDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# name (without _total), help; values from Engine.metrics
COUNTERS = [
    ("dflash_requests", "Requests finished (answered, cancelled or failed).", "requests_total"),
    ("dflash_requests_failed", "Requests that failed.", "requests_failed"),
    ("dflash_requests_cancelled", "Requests cancelled (client gone).", "cancelled_total"),
    ("dflash_prompt_tokens", "Prompt tokens of admitted requests.", "prompt_tokens_total"),
    ("dflash_prompt_tokens_reused", "Prompt tokens restored from the prompt cache instead of "
     "prefilled.", "prompt_tokens_reused_total"),
    ("dflash_tokens_generated", "Completion tokens generated.", "tokens_generated_total"),
    ("dflash_decode_steps", "Speculative (or autoregressive) steps of finished requests.",
     "steps_total"),
    ("dflash_draft_tokens", "Draft tokens proposed (tree nodes or chain positions verified).",
     "draft_tokens_total"),
    ("dflash_draft_tokens_accepted", "Draft tokens accepted by the target's verify.",
     "draft_accepted_total"),
    ("dflash_decode_seconds", "Seconds from first to last token, summed over requests.",
     "decode_seconds_total"),
    ("dflash_batch_resizes", "Times the batch changed bucket with rows live.", "batch_resizes_total"),
]


def parse(text: str) -> dict[str, float]:
  """{sample name: value} of a /metrics exposition (samples without labels; counters keep their
  `_total` name), read with prometheus_client's parser."""
  from prometheus_client.parser import text_string_to_metric_families
  return {smp.name: smp.value for fam in text_string_to_metric_families(text)
          for smp in fam.samples if not smp.labels}


class ServerMetrics:
  """Prometheus instruments of one Engine: `observe(latency_s, ttft_s)` per finished request;
  `text()` the exposition (counters and gauges from `engine_state()`: a dict with the
  Engine.metrics counters plus the gauges queue_waiting, batch_rows, batch_slots,
  batch_rows_peak, mean_acceptance_length, decode_tokens_per_second and the prompt cache's)."""

  def __init__(self, engine_state: Callable[[], dict]):
    self.registry = CollectorRegistry(auto_describe=True)
    self.latency = Histogram("dflash_request_seconds", "Request latency, arrival to last token.",
                             buckets=_SECONDS, registry=self.registry)
    self.ttft = Histogram("dflash_time_to_first_token_seconds", "Arrival to first token "
                          "(queue + prefill).", buckets=_SECONDS, registry=self.registry)
    self.registry.register(_EngineCollector(engine_state))
    ProcessCollector(registry=self.registry)   # process_resident_memory_bytes, cpu seconds, fds

  def observe(self, latency_s: float, ttft_s):
    self.latency.observe(latency_s)
    if ttft_s is not None:
      self.ttft.observe(ttft_s)

  def text(self) -> str:
    return generate_latest(self.registry).decode()


class _EngineCollector:
  def __init__(self, state: Callable[[], dict]):
    self.state = state

  def describe(self):
    return []                       # computed at scrape time only

  def collect(self):
    s = self.state()
    for name, doc, key in COUNTERS:
      c = CounterMetricFamily(name, doc)
      c.add_metric([], float(s.get(key, 0)))
      yield c
    gauges = [("dflash_queue_waiting", "Requests submitted and not finished (the queue bound).",
               "queue_waiting"),
              ("dflash_batch_rows", "Requests holding a batch slot now.", "batch_rows"),
              ("dflash_batch_slots", "Slots of the compiled batch now (its bucket).", "batch_slots"),
              ("dflash_batch_rows_peak", "Most requests that held slots at once.", "batch_rows_peak"),
              ("dflash_mean_acceptance_length", "Tokens per step over finished requests.",
               "mean_acceptance_length"),
              ("dflash_decode_tokens_per_second", "Generated tokens per decode second over "
               "finished requests.", "decode_tokens_per_second"),
              ("dflash_prompt_cache_bytes", "Bytes held by the prompt cache.", "prompt_cache_bytes"),
              ("dflash_prompt_cache_entries", "Sequences held by the prompt cache.",
               "prompt_cache_entries")]
    for name, doc, key in gauges:
      if key in s:
        g = GaugeMetricFamily(name, doc)
        g.add_metric([], float(s[key]))
        yield g
    if "memory_bytes" in s:
      g = GaugeMetricFamily("dflash_memory_bytes", "Device bytes by component (host memory on "
                            "the CPU backend).", labels=["component"])
      for component, n in s["memory_bytes"].items():
        g.add_metric([component], float(n))
      yield g
    for name, doc, key in [("dflash_prompt_cache_hits", "Requests that restored a cached prefix.",
                            "prompt_cache_hits"),
                           ("dflash_prompt_cache_evictions", "Prompt cache entries evicted.",
                            "prompt_cache_evictions")]:
      if key in s:
        c = CounterMetricFamily(name, doc)
        c.add_metric([], float(s[key]))
        yield c
