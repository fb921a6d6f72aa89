"""The server's Prometheus metrics, served at `GET /metrics`.

Names mirror vLLM's `vllm:` metrics where the meaning is the same, under an `lp:` prefix.
Times are in seconds. Every sample carries a `model_name` label (the served model name).

| name | type | meaning |
| --- | --- | --- |
| `lp:time_to_first_token_seconds` | histogram | arrival at the server to the first token |
| `lp:inter_token_latency_seconds` | histogram | every gap between consecutive tokens |
| `lp:time_per_output_token_seconds` | histogram | per request: (e2e - ttft) / (tokens - 1) |
| `lp:e2e_request_latency_seconds` | histogram | arrival to the last token |
| `lp:request_queue_time_seconds` | histogram | arrival to first admission by the scheduler |
| `lp:request_prompt_tokens` | histogram | prompt length of each finished request |
| `lp:request_generation_tokens` | histogram | output length of each finished request |
| `lp:num_requests_running` | gauge | admitted requests: prefilling or decoding |
| `lp:num_requests_waiting` | gauge | queued, not admitted (preempted ones included) |
| `lp:kv_cache_usage_perc` | gauge | fraction of KV pages in use, 0 to 1 (as vLLM) |
| `lp:engine_healthy` | gauge | 1 while the engine thread runs, 0 once it died |
| `lp:compilations_after_warmup` | gauge | XLA compilations after warm-up; should stay 0 |
| `lp:prompt_tokens_total` | counter | prompt tokens of requests that started generating |
| `lp:generation_tokens_total` | counter | output tokens generated for clients |
| `lp:request_success_total` | counter | finished requests by `finished_reason` (1) |
| `lp:request_rejected_total` | counter | rejected requests by `reason` (2) |
| `lp:num_preemptions_total` | counter | recompute preemptions |
| `lp:iterations_total` | counter | engine iterations by `phase` (3) |
| `lp:expert_bytes_loaded_total` | counter | expert weight bytes the MoE layers read |
| `lp:prefix_cache_queries_total` | counter | prompt tokens looked up in the prefix cache |
| `lp:prefix_cache_hits_total` | counter | those of them found there (prefill skipped) |
| `lp:spec_decode_num_drafts_total` | counter | speculating decodes verified (lp_jax/spec) |
| `lp:spec_decode_num_draft_tokens_total` | counter | draft tokens they verified |
| `lp:spec_decode_num_accepted_tokens_total` | counter | those of them accepted |
| `lp:spec_decode_num_accepted_tokens_per_pos_total` | counter | accepted, by `position` |
| `lp:kernel_backend_info` | gauge | 1 for the backend each op (`moe`, `attention`) runs |
| `lp:slo_requests_total` | counter | finished requests with an SLO, by `slo_class`, `kind` (4) |
| `lp:slo_attained_total` | counter | those of them that met it, by `slo_class`, `kind` (4) |

vLLM's names (`lp-serve --vllm-metric-names` exposes them too, with the same samples): only
where the meaning is the same. lp_jax's others (engine_healthy, compilations, iterations,
expert bytes, kernel backends, rejections, SLO attainment) have no vLLM counterpart.

| lp: name | vLLM name(s) |
| --- | --- |
| `lp:num_requests_running` | `vllm:num_requests_running` |
| `lp:num_requests_waiting` | `vllm:num_requests_waiting` |
| `lp:kv_cache_usage_perc` | `vllm:kv_cache_usage_perc` |
| `lp:prompt_tokens_total` | `vllm:prompt_tokens_total` |
| `lp:generation_tokens_total` | `vllm:generation_tokens_total` |
| `lp:request_success_total` | `vllm:request_success_total` |
| `lp:num_preemptions_total` | `vllm:num_preemptions_total` |
| `lp:prefix_cache_queries_total` | `vllm:prefix_cache_queries_total` (tokens) |
| `lp:prefix_cache_hits_total` | `vllm:prefix_cache_hits_total` (tokens) |
| `lp:spec_decode_num_*_total` (4 above) | `vllm:spec_decode_num_*_total` |
| `lp:time_to_first_token_seconds` | `vllm:time_to_first_token_seconds` |
| `lp:inter_token_latency_seconds` | `vllm:inter_token_latency_seconds`, and (5) |
| `lp:time_per_output_token_seconds` | `vllm:request_time_per_output_token_seconds` |
| `lp:e2e_request_latency_seconds` | `vllm:e2e_request_latency_seconds` |
| `lp:request_queue_time_seconds` | `vllm:request_queue_time_seconds` |
| `lp:request_prompt_tokens` | `vllm:request_prompt_tokens` |
| `lp:request_generation_tokens` | `vllm:request_generation_tokens` |

(5) `vllm:time_per_output_token_seconds`: vLLM's name for every gap before 0.11 renamed it.

A Grafana dashboard of the lp: metrics is docs/grafana/lp_jax.json.

Labels: (1) stop, length, abort (a client that left, before its request was queued too);
(2) invalid, overloaded, unauthorized, engine_dead, shutting_down; (3) decode, prefill,
hybrid, idle; (4) `slo_class`: the class the request named, or "custom" for explicit
`ttft_slo_ms` / `tbt_slo_ms` alone; `kind`: ttft (time to first token) or tbt (the largest
gap between two tokens). Attainment is `lp:slo_attained_total / lp:slo_requests_total`.

Request-level histograms are observed when a request finishes (or is aborted), from the
engine's own token timestamps; a request cut short by a stop string counts the tokens up to
the one that completed the stop string. `lp:generation_tokens_total` counts the same tokens
as they reach the handler, so it equals `lp:request_generation_tokens_sum` once no request
is in flight (the engine may make a token or two for a client that left: no one gets
them). Engine counters are read from `LLMEngine.stats()` at scrape time; the SLO counters
from its `slo_attainment` (requests that finish, and those aborted after their first token,
such as one cut short by a stop string).
"""

from __future__ import annotations

from lp_jax.server.prometheus import Registry

# `lp-serve --vllm-metric-names`: the vLLM names that mean what an lp: metric means (same
# type, unit, labels and definition), exposed beside the lp: name with the same samples, so
# a dashboard built for vLLM reads them. See the table above.
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "lp:num_requests_running": ("vllm:num_requests_running",),
    "lp:num_requests_waiting": ("vllm:num_requests_waiting",),
    "lp:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc",),
    "lp:prompt_tokens_total": ("vllm:prompt_tokens_total",),
    "lp:generation_tokens_total": ("vllm:generation_tokens_total",),
    "lp:request_success_total": ("vllm:request_success_total",),
    "lp:num_preemptions_total": ("vllm:num_preemptions_total",),
    "lp:prefix_cache_queries_total": ("vllm:prefix_cache_queries_total",),
    "lp:prefix_cache_hits_total": ("vllm:prefix_cache_hits_total",),
    **{f"lp:spec_decode_num_{x}_total": (f"vllm:spec_decode_num_{x}_total",)
       for x in ("drafts", "draft_tokens", "accepted_tokens", "accepted_tokens_per_pos")},
    "lp:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    # vLLM's time_per_output_token_seconds was every gap until it was renamed (v0.11)
    "lp:inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",
                                       "vllm:time_per_output_token_seconds"),
    "lp:time_per_output_token_seconds": ("vllm:request_time_per_output_token_seconds",),
    "lp:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "lp:request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "lp:request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "lp:request_generation_tokens": ("vllm:request_generation_tokens",),
}

# Bucket bounds in seconds (and tokens), spread over the range a serving system sees.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 80.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0,
                   45.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000)

PHASES = ("decode", "prefill", "hybrid", "idle")
SLO_KINDS = ("ttft", "tbt")
FINISH_REASONS = ("stop", "length", "abort")


class ServerMetrics:
    """The server's metric families; `vllm_names`: also render each under VLLM_NAMES."""

    def __init__(self, model_name: str, *, vllm_names: bool = False):
        r = self.registry = Registry({"model_name": model_name},
                                     aliases=VLLM_NAMES if vllm_names else None)
        self.ttft = r.histogram("lp:time_to_first_token_seconds",
                                "Time to first token in seconds.", TTFT_BUCKETS)
        self.itl = r.histogram("lp:inter_token_latency_seconds",
                               "Inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = r.histogram("lp:time_per_output_token_seconds",
                                "Mean time per output token of a request in seconds.",
                                ITL_BUCKETS)
        self.e2e = r.histogram("lp:e2e_request_latency_seconds",
                               "End-to-end request latency in seconds.", REQUEST_BUCKETS)
        self.queue = r.histogram("lp:request_queue_time_seconds",
                                 "Time from arrival to first admission in seconds.",
                                 TTFT_BUCKETS)
        self.prompt_len = r.histogram("lp:request_prompt_tokens",
                                      "Prompt tokens per finished request.", TOKEN_BUCKETS)
        self.gen_len = r.histogram("lp:request_generation_tokens",
                                   "Generated tokens per finished request.", TOKEN_BUCKETS)
        self.running = r.gauge("lp:num_requests_running",
                               "Requests admitted by the scheduler (prefilling or decoding).")
        self.waiting = r.gauge("lp:num_requests_waiting",
                               "Requests waiting for admission, preempted ones included.")
        self.kv_usage = r.gauge("lp:kv_cache_usage_perc",
                                "Fraction of KV cache pages in use (1 means full).")
        self.healthy = r.gauge("lp:engine_healthy", "1 while the engine thread is alive.")
        self.prompt_tokens = r.counter("lp:prompt_tokens_total",
                                       "Prompt tokens of requests that started generating.")
        self.generation_tokens = r.counter("lp:generation_tokens_total",
                                           "Generated tokens streamed to clients.")
        self.success = r.counter("lp:request_success_total", "Finished requests.",
                                 ("finished_reason",))
        self.rejected = r.counter("lp:request_rejected_total",
                                  "Requests rejected before generating.", ("reason",))
        self.preemptions = r.counter("lp:num_preemptions_total", "Recompute preemptions.")
        self.iterations = r.counter("lp:iterations_total", "Engine iterations by phase.",
                                    ("phase",))
        self.expert_bytes = r.counter("lp:expert_bytes_loaded_total",
                                      "Expert weight bytes read by the MoE layers.")
        self.prefix_queries = r.counter("lp:prefix_cache_queries_total",
                                        "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = r.counter("lp:prefix_cache_hits_total",
                                     "Prompt tokens found in the prefix cache.")
        self.spec = {x: r.counter(f"lp:spec_decode_num_{x}_total", doc) for x, doc in (
            ("drafts", "Speculating decodes verified."),
            ("draft_tokens", "Draft tokens verified."),
            ("accepted_tokens", "Draft tokens accepted."))}
        self.spec_per_pos = r.counter("lp:spec_decode_num_accepted_tokens_per_pos_total",
                                      "Draft tokens accepted, by position in the draft.",
                                      ("position",))
        self.compilations_after_warmup = r.gauge(
            "lp:compilations_after_warmup", "XLA compilations after warm-up (should stay 0).")
        self.kernel_backend = r.gauge("lp:kernel_backend_info",
                                      "The kernel backend each op runs (after the start-up "
                                      "self-test and any fallback).", ("op", "backend"))
        self.slo_requests = r.counter("lp:slo_requests_total",
                                      "Finished requests with a latency SLO of this kind.",
                                      ("slo_class", "kind"))
        self.slo_attained = r.counter("lp:slo_attained_total",
                                      "Finished requests that met their latency SLO.",
                                      ("slo_class", "kind"))
        for reason in FINISH_REASONS:
            self.success.inc(0, finished_reason=reason)
        for phase in PHASES:
            self.iterations.inc(0, phase=phase)
        self.healthy.set(1)

    def declare_slo_classes(self, classes: dict) -> None:
        """Zero SLO counters for each configured class and kind it sets an objective for
        (`classes`: name -> SLO), so that rates exist before the first request finishes."""
        for name, slo in classes.items():
            for kind in SLO_KINDS:
                if getattr(slo, f"{kind}_s", None) is not None:
                    self.slo_requests.inc(0, slo_class=name, kind=kind)
                    self.slo_attained.inc(0, slo_class=name, kind=kind)

    def observe_finished(self, *, reason: str, metrics, num_tokens: int,
                         num_prompt_tokens: int) -> None:
        """One finished request; `metrics` is its RequestMetrics, cut to `num_tokens`."""
        self.success.inc(1, finished_reason=reason)
        self.prompt_len.observe(num_prompt_tokens)
        self.gen_len.observe(num_tokens)
        times = metrics.token_times[:num_tokens] if metrics is not None else ()
        if not times:
            return
        arrival = metrics.arrival_time
        self.ttft.observe(times[0] - arrival)
        self.itl.observe_many(b - a for a, b in zip(times, times[1:], strict=False))
        self.e2e.observe(times[-1] - arrival)
        if len(times) > 1:
            self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))

    def update_from_engine(self, stats: dict, *, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        total = stats.get("total_pages") or 0
        free = stats.get("free_pages", total)
        self.kv_usage.set((total - free) / total if total else 0.0)
        for phase in PHASES:
            self.iterations.set_total(stats.get(f"iterations_{phase}", 0), phase=phase)
        self.expert_bytes.set_total(stats.get("expert_bytes_loaded", 0))
        self.preemptions.set_total(stats.get("preemptions", 0))
        self.prefix_queries.set_total(stats.get("prefix_cache_queries", 0))
        self.prefix_hits.set_total(stats.get("prefix_cache_hits", 0))
        for x, counter in self.spec.items():
            counter.set_total(stats.get(f"spec_decode_num_{x}", 0))
        pos_prefix = "spec_decode_num_accepted_tokens_pos_"
        self.spec_per_pos.set_total(stats.get(f"{pos_prefix}0", 0), position="0")  # a sample
        for key, v in stats.items():  # even before the first draft, as for every counter
            if key.startswith(pos_prefix):
                self.spec_per_pos.set_total(v, position=key[len(pos_prefix):])
        self.compilations_after_warmup.set(stats.get("compilations_after_warmup", 0))
        for op, backend in stats.get("kernel_backends", {}).items():
            self.kernel_backend.set(1, op=op, backend=backend)
        for name, kinds in stats.get("slo_attainment", {}).items():
            for kind, c in kinds.items():
                self.slo_requests.set_total(c["total"], slo_class=name, kind=kind)
                self.slo_attained.set_total(c["attained"], slo_class=name, kind=kind)

    def render(self) -> str:
        return self.registry.render()
