"""GPT-OSS harmony tool calls on the compiled tiny GPT-OSS model, through lp-serve.

The test suite checks the harmony grammar on the host and on the fake executor (nothing
compiled, tests/test_tool_calls.py); this runs it on the real model: the tiny GPT-OSS
weights (random) with harmony's markers as special tokens (make_tiny's
`write_harmony_variant`), compiled for one 256-token program, served in-process, and
--requests chat requests per tool_choice ("required", then the named function) at
temperature 1 through the official openai client, half of them streamed. Only the
grammar's bitmask keeps random weights to a well-formed call, so the check is that every
answer is one call whose arguments validate, with finish_reason tool_calls, and that a
streamed call reassembles from its fragments. A logit bias on `<|end|>` keeps the free
analysis short (random weights would rarely end it). Prints the counts, the tokens per
answer and the grammar's host time per constrained token (engine stats).

    JAX_PLATFORMS=cpu .venv/bin/python launch/check_harmony_tools.py --requests 8
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 5}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}}}}}


def valid(name: str, arguments: str) -> bool:
    args = json.loads(arguments)
    if name == "get_weather":
        return list(args) == ["city"] and 1 <= len(args["city"]) <= 5
    return name == "get_time" and list(args) == ["zone"] and -12 <= args["zone"] <= 12


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8, help="per tool_choice")
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--end-bias", type=float, default=5.0, help="logit bias on <|end|>")
    args = ap.parse_args(argv)

    import openai

    from checkpoints.make_tiny import write_harmony_variant
    from lp_jax.engine.config import EngineConfig
    from lp_jax.engine.llm_engine import LLMEngine
    from lp_jax.server import OpenAIServer, ServerThread

    model_dir = write_harmony_variant(Path(tempfile.mkdtemp(prefix="tiny-gpt-oss-harmony.")))
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(
        model=str(model_dir), scheduling="chunked", max_num_seqs=4, max_model_len=2048,
        max_num_batched_tokens=256, token_buckets=(256,), backends="off"), log=None)
    print(f"engine ready in {time.perf_counter() - t0:.1f} s")
    end = engine.tokenizer.token_to_id("<|end|>")
    st = ServerThread(OpenAIServer(engine, served_model_names=["m"])).start()
    ok = total = thought = 0
    tokens = []
    try:
        client = openai.OpenAI(base_url=f"{st.url}/v1", api_key="unused", max_retries=0,
                               timeout=300)
        for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
            for seed in range(args.requests):
                kw = dict(model="m", messages=[{"role": "user", "content": "Weather?"}],
                          tools=[WEATHER, TIME], tool_choice=choice, temperature=1.0,
                          seed=seed, max_tokens=args.max_tokens,
                          logit_bias={str(end): args.end_bias})
                total += 1
                if seed % 2:  # streamed: reassembled from the fragments
                    name, arguments, reason, n, r = None, "", None, 0, ""
                    for chunk in client.chat.completions.create(stream=True, **kw):
                        r += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
                        for d in chunk.choices[0].delta.tool_calls or []:
                            name = name or d.function.name
                            arguments += d.function.arguments or ""
                        reason = chunk.choices[0].finish_reason or reason
                        n += 1
                    calls = [(name, arguments)] if name else []
                else:
                    resp = client.chat.completions.create(**kw)
                    msg, reason = resp.choices[0].message, resp.choices[0].finish_reason
                    calls = [(c.function.name, c.function.arguments)
                             for c in msg.tool_calls or []]
                    n = resp.usage.completion_tokens
                    r = getattr(msg, "reasoning_content", None) or ""
                good = (reason == "tool_calls" and len(calls) == 1 and valid(*calls[0])
                        and (choice == "required" or calls[0][0] == "get_time"))
                ok += good
                thought += bool(r)
                tokens.append(n)
                print(f"{json.dumps(choice)[:60]:<62} seed {seed} {'stream' if seed % 2 else ''}"
                      f"\t{reason}\t{calls}")
        stats = st.engine_call(lambda e: e.stats())
    finally:
        st.stop()
    so = stats["structured_outputs"]
    per_token = (so["fill_s"] + so["advance_s"]) / max(1, so["filled"]) * 1e6
    print(f"valid calls: {ok} of {total} ({thought} after an analysis message); tokens "
          f"(or chunks) per answer: mean "
          f"{sum(tokens) / len(tokens):.1f}; grammar host time {per_token:.1f} us per "
          f"constrained token ({so['filled']} masks); compilations after warm-up: "
          f"{stats['compilations_after_warmup']}")
    return 0 if ok == total else 1


if __name__ == "__main__":
    sys.exit(main())
