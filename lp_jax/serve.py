"""`lp-serve`: the OpenAI-compatible server (see lp_jax/server/__init__.py for the API).

Engine flags are named as vLLM names them where the meaning is the same
(`--max-model-len`, `--max-num-seqs`, `--max-num-batched-tokens`, `--load-format`,
`--dtype`, `--quantization`, `--kv-cache-dtype`, `--seed`); the rest are lp_jax's own
(`--scheduling`, `--layer-groups`, ...).

    LP_API_KEY=... lp-serve --model /path/to/Qwen3-30B-A3B --scheduling layered --port 8000

SIGTERM drains: new requests get 503, those in flight get `--shutdown-grace` seconds to
finish, then the process exits 0. Ctrl-C stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from pathlib import Path


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _positive_float(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {s}")
    return v


def _int_tuple(s: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in s.replace(" ", "").split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {s!r}") from None


def _layer_groups(s: str):
    return int(s) if s.isdigit() else s


def _non_negative_int(s: str) -> int:
    v = int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _slo_alpha(s: str) -> float:
    v = float(s)
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {s}")
    return v


def _speculative_config(s: str):
    """--speculative-config: vLLM's JSON, checked now (lp_jax/spec/config.py)."""
    from lp_jax.spec.config import SpeculativeConfig

    try:
        return SpeculativeConfig.parse(s)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _slo_classes(s: str) -> dict:
    """--slo-classes: inline JSON or a JSON file's path, checked now (a bad file stops
    start-up with its error, not the first request that names a class)."""
    from lp_jax.core.slo import parse_slo_classes

    try:
        text = s if s.lstrip().startswith("{") else Path(s).read_text()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read SLO classes file {s!r}: "
                                         f"{exc.strerror}") from None
    try:
        spec = json.loads(text)
        parse_slo_classes(spec)
    except ValueError as exc:  # JSONDecodeError included
        raise argparse.ArgumentTypeError(f"bad SLO classes in {s[:200]!r}: {exc}") from None
    return spec


def _chat_template(s: str) -> str:
    """--chat-template FILE: its Jinja source, read and compiled now (a missing file or a
    syntax error stops start-up, naming the file and the line)."""
    from lp_jax.server.chat import read_template_file

    try:
        return read_template_file(s)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _existing_path(s: str) -> str:
    if not Path(s).exists():
        raise argparse.ArgumentTypeError(f"{s!r} does not exist")
    return s


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):
        if action.default is None and "[default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    from lp_jax.server.protocol import DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES
    from lp_jax.version import lp_jax_version

    p = argparse.ArgumentParser(prog="lp-serve", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"lp-serve {lp_jax_version()}")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes and /metrics; "
                        "the LP_API_KEY environment variable keeps it out of the process list")
    s.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without the API key")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use [default: the --model directory's name, "
                        "or 'tiny']")
    s.add_argument("--max-waiting", type=_positive_int, default=None,
                   help="requests allowed to wait beyond the free slots (--max-num-seqs); "
                        "beyond it: 503 + Retry-After")
    s.add_argument("--max-n", type=_positive_int, default=16,
                   help="most choices per prompt a request may ask for ('n'); beyond: 400")
    s.add_argument("--max-prompt-logprob-entries", type=_positive_int,
                   default=DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES,
                   help="most prompt log-probability entries a request may ask for (prompt "
                        "tokens x n x (prompt_logprobs + 1), over all its prompts; about 60 "
                        "bytes of JSON each); beyond: 400")
    s.add_argument("--chat-template", type=_chat_template, default=None, metavar="FILE",
                   help="a Jinja chat template file, used instead of the model's (for "
                        "checkpoints without one) [default: the model's, or a fallback]")
    s.add_argument("--reasoning-parser", choices=["qwen3"], default=None,
                   help="chat answers' reasoning (Qwen3's <think> block) goes to "
                        "reasoning_content / reasoning, apart from content [default: none]")
    s.add_argument("--vllm-metric-names", action="store_true",
                   help="/metrics also exposes the vllm: names of the metrics that mean the "
                        "same (lp_jax/server/metrics.py), for dashboards built for vLLM")
    s.add_argument("--read-timeout", type=_positive_float, default=60.0,
                   help="seconds a client has to send a request's headers, and then its body")
    s.add_argument("--shutdown-grace", type=_positive_float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    s.add_argument("--log-level", default="info")
    s.add_argument("--log-stats-interval", type=_positive_float, default=10.0, metavar="S",
                   help="seconds between stats lines (throughput, running and waiting "
                        "requests, KV usage, prefix-cache hits, preemptions) while serving")
    s.add_argument("--disable-log-stats", action="store_true", help="no stats lines")
    s.add_argument("--access-log", action="store_true", help="log every HTTP request")
    s.add_argument("--mock-engine", action="store_true",
                   help="serve a JAX-free engine that generates instantly (times the HTTP "
                        "layer; tokenizer and chat template from --model or the tiny model)")
    e = p.add_argument_group("engine (EngineConfig)")
    e.add_argument("--model", default=None,
                   help="Hugging Face model directory [default: the embedded fable model "
                        "of checkpoints/train_demo.py]")
    e.add_argument("--scheduling", "--scheduler-cls", default="layered", metavar="POLICY",
                   help="orca, chunked, layered, flowprefill (slack-aware EDF over the "
                        "requests' TTFT deadlines, with preemptible prefill: "
                        "--preemption-granularity), or your own Policy class as "
                        "package.module:Class (docs/custom_policy.md)")
    e.add_argument("--max-model-len", type=_positive_int, default=None)
    e.add_argument("--max-num-seqs", type=_positive_int, default=32)
    e.add_argument("--max-num-batched-tokens", type=_positive_int, default=None)
    e.add_argument("--layer-groups", type=_layer_groups, default="paper",
                   help="'paper', 'pow2', 'adaptive' (with --tbt-slo-ms) or a fixed group count")
    e.add_argument("--max-layer-groups", type=_positive_int, default=16)
    e.add_argument("--page-size", type=_positive_int, default=16, help="KV page (block) size")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="share the KV pages of equal prompt prefixes "
                                      "[default: on]")
    e.add_argument("--kv-pages", type=_positive_int, default=None)
    e.add_argument("--kv-memory-fraction", type=float, default=0.5)
    e.add_argument("--load-format", choices=("auto", "safetensors", "dummy", "orbax"),
                   default="auto")
    e.add_argument("--mesh-shape", type=_int_tuple, default=None,
                   help="'expert,tensor' or 'data,expert,tensor'")
    e.add_argument("--dtype", default=None)
    e.add_argument("--quantization", "-q", choices=("int8", "fp8", "mxfp4"), default=None,
                   help="int8 / fp8: quantise a 16-bit checkpoint per channel at load (an HF "
                        "FP8 checkpoint is detected from its config.json); mxfp4: keep "
                        "GPT-OSS's MXFP4 experts in 4 bits")
    from lp_jax.config import KV_CACHE_DTYPES  # light (no jax)

    e.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="fp8 / fp8_e4m3: float8_e4m3fn KV pages with the checkpoint's "
                        "k_scale / v_scale (else 1.0), half the bytes per page [default: auto]")
    e.add_argument("--moe-backend", default="auto")
    e.add_argument("--moe-dispatch", choices=("auto", "allreduce", "all_to_all"),
                   default="auto", help="expert-parallel MoE communication [default: auto]")
    e.add_argument("--attention-backend", default="auto")
    e.add_argument("--backends", default="fallback", choices=("fallback", "strict", "off"),
                   help="start-up self-test of the Pallas kernels: fall back to a safe "
                        "backend, fail, or skip it")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--token-buckets", type=_int_tuple, default=None,
                   help="row counts to compile a step program for [default: 1, 4, 16, "
                        "64, powers of two to 512, then x1.5 steps to the budget]")
    e.add_argument("--no-warmup", dest="warmup", action="store_false")
    e.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   help="commit each step before planning the next")
    e.add_argument("--compilation-cache-dir", default=None,
                   help="persistent XLA cache [default: ~/.cache/lp_jax/jax_cache]; '' for none")
    e.add_argument("--trace", dest="trace_path", default=None, metavar="PATH",
                   help="write the decision trace (one JSON line per plan and request "
                        "event) here; python -m lp_jax.trace plot PATH draws it")
    e.add_argument("--speculative-config", type=_speculative_config, default=None,
                   metavar="JSON",
                   help='speculative decoding, vLLM\'s JSON: {"method": "ngram", '
                        '"num_speculative_tokens": 3, "prompt_lookup_max": 3} '
                        '(docs/speculative.md)')
    f = p.add_argument_group("latency SLOs and FlowPrefill (EngineConfig)")
    f.add_argument("--slo-classes", type=_slo_classes, default=None,
                   help='named SLO classes requests may give as slo_class: inline JSON or a '
                        'JSON file, e.g. {"chat": {"ttft_ms": 250, "tbt_ms": 100}}')
    f.add_argument("--tbt-slo-ms", type=float, default=None,
                   help='--layer-groups adaptive: keep each step within this TBT objective')
    f.add_argument("--adaptive-margin", type=_slo_alpha, default=0.1,
                   help="--layer-groups adaptive: headroom under the TBT objective")
    f.add_argument("--preemption-granularity", choices=("operator", "layer", "group"),
                   default="operator", help="where a flowprefill prefill may be paused")
    f.add_argument("--preemptible", action="store_true",
                   help="layered: a prefill batch may be preempted at its group boundaries")
    f.add_argument("--slo-alpha", type=_slo_alpha, default=0.1,
                   help="SLO-aware batching's margin, alpha * the TTFT SLO")
    f.add_argument("--flowprefill-rules", choices=("reference", "lp_jax"), default="reference",
                   help="flowprefill's ranking and batching: the released FlowPrefill code's "
                        "(reference) or lp_jax's earlier ones [default: reference]")
    f.add_argument("--flowprefill-lookahead", type=_positive_int, default=1,
                   help="flowprefill: segments of the running prefill one plan carries (one "
                        "host plan, dispatch and commit); an urgent arrival waits for at most "
                        "k + 1 segments [default: 1]")
    f.add_argument("--max-paused-prefills", type=_non_negative_int, default=8,
                   help="paused prefill batches whose hidden states stay on the device")
    f.add_argument("--latency-model", type=_existing_path, default=None,
                   help="fitted step-latency model (python -m lp_jax.engine.profile_latency) "
                        "[default: fitted online]")
    f.add_argument("--prefill-only", action="store_true",
                   help="every request ends at its first token (disaggregated prefill)")
    d = p.add_argument_group("several processes (one per host); process 0 serves HTTP")
    d.add_argument("--num-processes", type=_positive_int, default=None,
                   help="[default: $LP_NUM_PROCESSES, a detected TPU pod or SLURM job, or 1]")
    d.add_argument("--process-id", type=int, default=None, help="[default: $LP_PROCESS_ID]")
    d.add_argument("--coordinator-address", default=None,
                   help="host:port of process 0 [default: $LP_COORDINATOR_ADDRESS]")
    d.add_argument("--plan-channel", choices=("host", "device"), default="host",
                   help="how the leader sends each step to the followers [default: host]")
    d.add_argument("--follower-timeout-s", type=_positive_float, default=60.0,
                   help="a follower silent this long stops the leader [default: 60]")
    return p


ENGINE_FLAGS = ("model", "scheduling", "max_model_len", "max_num_seqs",
                "max_num_batched_tokens", "layer_groups", "max_layer_groups", "page_size",
                "enable_prefix_caching", "kv_pages", "kv_memory_fraction", "load_format",
                "mesh_shape", "dtype", "quantization", "kv_cache_dtype", "moe_backend",
                "attention_backend",
                "backends", "seed",
                "token_buckets", "warmup",
                "async_scheduling", "preemption_granularity", "preemptible", "slo_alpha",
                "flowprefill_rules", "flowprefill_lookahead", "max_paused_prefills",
                "slo_classes", "latency_model", "prefill_only",
                "tbt_slo_ms", "adaptive_margin", "moe_dispatch", "num_processes", "process_id",
                "coordinator_address", "plan_channel", "follower_timeout_s", "trace_path",
                "speculative_config")


def engine_config(args):
    from lp_jax.engine.config import EngineConfig

    kwargs = {k: getattr(args, k) for k in ENGINE_FLAGS}
    if args.compilation_cache_dir is not None:
        kwargs["compilation_cache_dir"] = args.compilation_cache_dir or None
    return EngineConfig(**kwargs)


def build_engine(args, log=print):
    if args.mock_engine:
        from checkpoints.make_tiny import ensure_tiny
        from lp_jax.server.mock import MockEngine

        return MockEngine(model_dir=args.model or ensure_tiny(preset="tiny"),
                          max_model_len=args.max_model_len or 4096,
                          max_num_seqs=max(args.max_num_seqs, 256),
                          slo_classes=args.slo_classes)
    from lp_jax.engine.llm_engine import LLMEngine

    return LLMEngine(engine_config(args), log=log)


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("lp_jax.serve")
    try:
        config = None if args.mock_engine else engine_config(args)
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"lp-serve: bad engine arguments: {exc}") from None
    log.info("engine config: %s", config or "mock engine")
    engine = build_engine(args, log=log.info)
    if not getattr(engine, "is_leader", True):  # a follower: no HTTP, the leader's steps
        steps = engine.serve_follower()
        log.info("the leader stopped; follower ran %d steps", steps)
        return
    from lp_jax.server import OpenAIServer, serve

    names = args.served_model_name or [Path(args.model).name if args.model else "tiny"]
    server = OpenAIServer(engine, served_model_names=names,
                          api_key=args.api_key or os.environ.get("LP_API_KEY"),
                          max_waiting=args.max_waiting, metrics_public=args.metrics_public,
                          read_timeout=args.read_timeout, max_n=args.max_n,
                          max_prompt_logprob_entries=args.max_prompt_logprob_entries,
                          chat_template=args.chat_template,
                          vllm_metric_names=args.vllm_metric_names,
                          reasoning_parser=args.reasoning_parser,
                          log_stats_s=None if args.disable_log_stats else args.log_stats_interval)
    try:
        asyncio.run(serve(server, args.host, args.port, access_log=args.access_log,
                          grace_s=args.shutdown_grace))
    except KeyboardInterrupt:
        pass
    finally:
        if hasattr(engine, "shutdown"):
            engine.shutdown()  # stops the followers of a multi-process engine


if __name__ == "__main__":
    main()
