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
import logging
import os
from pathlib import Path

from lp_jax.engine_args import positive_float, positive_int


def _chat_template(s: str) -> str:
    """--chat-template FILE: its Jinja source, read and compiled now (a missing file or a
    syntax error stops start-up, naming the file and the line)."""
    from lp_jax.server.chat import read_template_file

    try:
        return read_template_file(s)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds each flag's default, unless its help already says it (the engine flags')."""

    def _get_help_string(self, action):
        if "[default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


# The engine flags for several processes, in their own help group.
PROCESS_FLAGS = ("num_processes", "process_id", "coordinator_address", "plan_channel",
                 "follower_timeout_s")


def build_parser(prog: str = "lp-serve") -> argparse.ArgumentParser:
    """The server's own flags, then every engine flag (lp_jax/engine_args.py)."""
    from lp_jax.engine_args import add_engine_args, engine_flags
    from lp_jax.version import lp_jax_version

    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"{prog} {lp_jax_version()}")
    _add_server_args(p)
    add_engine_args(p.add_argument_group("engine (EngineConfig; docs/engine_args.md)"),
                    only=[n for n in engine_flags() if n not in PROCESS_FLAGS])
    add_engine_args(p.add_argument_group(
        "several processes (one per host); process 0 serves HTTP"), only=PROCESS_FLAGS)
    return p


def _add_server_args(p: argparse.ArgumentParser) -> None:
    from lp_jax.server.app import keyed_paths
    from lp_jax.server.protocol import (
        DEFAULT_MAX_LOGPROB_ENTRIES,
        DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES,
        DEFAULT_MAX_REQUEST_SEQS,
    )

    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on "
                        f"{', '.join(keyed_paths())} (/metrics not with --metrics-public); "
                        "the LP_API_KEY environment variable keeps it out of the process "
                        "list; an empty key stops start-up")
    s.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without the API key")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use [default: the --model directory's name, "
                        "or 'tiny']")
    s.add_argument("--max-waiting", type=positive_int, default=None,
                   help="sequences (a request's prompts x n) allowed to wait beyond the "
                        "free slots (--max-num-seqs); beyond it: 503 + Retry-After; a request "
                        "of more than --max-num-seqs + this many sequences: 400")
    s.add_argument("--max-request-seqs", type=positive_int, default=DEFAULT_MAX_REQUEST_SEQS,
                   help="most sequences (prompts x n) one request may run; beyond: 400")
    s.add_argument("--max-logprob-entries", type=positive_int,
                   default=DEFAULT_MAX_LOGPROB_ENTRIES,
                   help="most log-probability entries one response may carry: prompt entries "
                        "plus max_tokens x n x (logprobs + 1) over its prompts; beyond: 400")
    s.add_argument("--max-n", type=positive_int, default=16,
                   help="most choices per prompt a request may ask for ('n'); beyond: 400")
    s.add_argument("--max-prompt-logprob-entries", type=positive_int,
                   default=DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES,
                   help="most prompt log-probability entries a request may ask for (prompt "
                        "tokens x n x (prompt_logprobs + 1), over all its prompts; about 60 "
                        "bytes of JSON each); beyond: 400")
    s.add_argument("--chat-template", type=_chat_template, default=None, metavar="FILE",
                   help="a Jinja chat template file, used instead of the model's (for "
                        "checkpoints without one) [default: the model's, or a fallback]")
    from lp_jax.server.reasoning import PARSERS as REASONING_PARSERS
    from lp_jax.server.tool_formats import FORMATS as TOOL_FORMATS

    s.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="chat answers' reasoning (the <think> block of Qwen3, GLM-4.5 or "
                        "DeepSeek-R1) goes to reasoning_content / reasoning, apart from "
                        "content [default: none]")
    s.add_argument("--tool-call-parser", choices=TOOL_FORMATS, default=None,
                   help="the text format of the model's tool calls [default: the model's: "
                        "glm45 for GLM-4.5 / 4.6, qwen3 otherwise; GPT-OSS: harmony]")
    s.add_argument("--vllm-metric-names", action="store_true",
                   help="/metrics also exposes the vllm: names of the metrics that mean the "
                        "same (lp_jax/server/metrics.py), for dashboards built for vLLM")
    s.add_argument("--read-timeout", type=positive_float, default=60.0,
                   help="seconds a client has to send a request's headers, and then its body")
    s.add_argument("--shutdown-grace", type=positive_float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    s.add_argument("--log-level", default="info")
    s.add_argument("--log-stats-interval", type=positive_float, default=10.0, metavar="S",
                   help="seconds between stats lines (throughput, running and waiting "
                        "requests, KV usage, prefix-cache hits, preemptions) while serving")
    s.add_argument("--disable-log-stats", action="store_true", help="no stats lines")
    s.add_argument("--access-log", action="store_true", help="log every HTTP request")
    s.add_argument("--mock-engine", action="store_true",
                   help="serve a JAX-free engine that generates instantly (times the HTTP "
                        "layer; tokenizer and chat template from --model or the tiny model)")


def engine_config(args):
    from lp_jax.engine.config import EngineConfig
    from lp_jax.engine_args import engine_kwargs

    return EngineConfig(**engine_kwargs(args))


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


def main(argv=None, prog: str = "lp-serve") -> None:
    args = build_parser(prog).parse_args(argv)
    api_key = args.api_key if args.api_key is not None else os.environ.get("LP_API_KEY")
    if api_key is not None and not api_key.strip():
        raise SystemExit(f"{prog}: the API key is empty (--api-key or LP_API_KEY): that "
                         "would turn authentication off; give a key, or unset it")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("lp_jax.serve")
    try:
        config = None if args.mock_engine else engine_config(args)
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"{prog}: bad engine arguments: {exc}") from None
    log.info("engine config: %s", config or "mock engine")
    try:
        engine = build_engine(args, log=log.info)
    except ValueError as exc:  # a model (or its draft) the engine cannot serve, named
        raise SystemExit(f"{prog}: {exc}") from None
    if not getattr(engine, "is_leader", True):  # a follower: no HTTP, the leader's steps
        steps = engine.serve_follower()
        log.info("the leader stopped; follower ran %d steps", steps)
        return
    from lp_jax.server import OpenAIServer, serve

    names = args.served_model_name or [Path(args.model).name if args.model else "tiny"]
    server = OpenAIServer(engine, served_model_names=names,
                          api_key=api_key, max_request_seqs=args.max_request_seqs,
                          max_logprob_entries=args.max_logprob_entries,
                          max_waiting=args.max_waiting, metrics_public=args.metrics_public,
                          read_timeout=args.read_timeout, max_n=args.max_n,
                          max_prompt_logprob_entries=args.max_prompt_logprob_entries,
                          chat_template=args.chat_template,
                          vllm_metric_names=args.vllm_metric_names,
                          reasoning_parser=args.reasoning_parser,
                          tool_call_parser=args.tool_call_parser,
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
