"""From a generation request's body to queued engine requests: parse it, check the model
and the SLO fields, tokenize every prompt on a worker thread, check the limits (n, sequences,
prompt bytes, context length, log-probability entries) and queue every prompt's samples,
all or none. The count limits are checked before any tokenizing where the count is known
(n, sequences) and before anything is queued otherwise, so that a request too big to answer
costs no engine work.

Every refusal is an `APIError` (a 400 naming the field, a 503 when overloaded), counted in
`server.metrics.rejected` by reason. The functions take the `OpenAIServer` they answer for
as their first argument.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from lp_jax.paths import no_tokenizer_reason
from lp_jax.server import harmony, protocol, reasoning, tool_formats, tools
from lp_jax.server.chat import ChatTemplateError
from lp_jax.server.choice import Choice
from lp_jax.server.engine_loop import EngineDeadError, NeverFitsError, OverloadedError
from lp_jax.server.protocol import APIError

RETRY_AFTER_S = 1


async def read_request(server, request, parse):
    """The request `parse` makes of the body, for a served model, its SLO resolved."""
    try:
        req = parse(protocol.parse_json(await server.read_body(request)))
        server.check_model(req.model)
        req.slo = _resolve_slo(server, req.slo_fields)
        return req
    except APIError:
        server.metrics.rejected.inc(reason="invalid")
        raise


def _resolve_slo(server, fields: dict | None):
    """The engine's SLO for a request's SLO fields (None: none given); a 400 naming the
    field for an unknown class or a value the engine refuses, before anything is queued.
    `resolve_slo` only reads the classes fixed at start-up, so any thread may call it."""
    if fields is None:
        return None
    resolve = getattr(server.engine, "resolve_slo", None)
    if resolve is None:
        raise protocol.unsupported(next(iter(fields)), "this engine has no latency SLOs")
    try:
        return resolve(fields)
    except ValueError as exc:
        msg = str(exc)
        param = next((f for f in protocol.SLO_FIELDS if f in msg and f in fields),
                     next(iter(fields)))
        raise protocol.bad(msg, param) from None


def _tokenize(server, req, prompt) -> list[int]:
    """Runs on a worker thread, so that a long prompt does not stall the event loop.
    `encode_batch` releases the GIL while it works; `encode` holds it throughout."""
    if req.kind == "chat":
        try:
            text = server.chat.render(req.messages, req.add_generation_prompt,
                                      req.chat_template_kwargs, req.tools)
        except ChatTemplateError as exc:
            raise protocol.bad(str(exc), "messages") from None
        if server.tokenizer is None:
            raise protocol.bad(no_tokenizer_reason(server.model_dir), "messages")
        ids = server.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
    elif isinstance(prompt, str):
        if server.tokenizer is None:
            raise protocol.bad(no_tokenizer_reason(server.model_dir), "prompt")
        ids = server.tokenizer.encode_batch([prompt])[0].ids
    else:
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < server.vocab_size]
        if bad:
            raise protocol.bad(f"token ids {bad[:5]} outside [0, {server.vocab_size})",
                               "prompt")
    if not ids:
        raise protocol.bad("the prompt is empty after tokenization", "prompt")
    return ids


def _budget(server, req, n_prompt: int) -> int:
    limit = server.max_model_len
    if n_prompt > limit:
        raise protocol.bad(f"this model's maximum context length is {limit} tokens; the "
                           f"prompt has {n_prompt}", "prompt")
    if req.max_tokens is None:
        if n_prompt >= limit:  # no room for one output token
            raise protocol.bad(
                f"this model's maximum context length is {limit} tokens; the prompt has "
                f"{n_prompt}, which leaves no room for a completion token", "prompt")
        return limit - n_prompt
    if n_prompt + req.max_tokens > limit:
        raise protocol.bad(
            f"this model's maximum context length is {limit} tokens; you requested "
            f"{n_prompt + req.max_tokens} ({n_prompt} in the prompt, {req.max_tokens} "
            "in the completion)", "max_tokens")
    return req.max_tokens


async def submit(server, req) -> list[Choice]:
    """Tokenizes every prompt and queues each prompt's `n` samples, all or none; one
    `Choice` per sample, in OpenAI's choice order (prompt-major)."""
    arrival = time.perf_counter()
    try:
        if req.n > server.max_n:
            raise protocol.bad(f"'n' must be at most {server.max_n} (this server's --max-n), "
                               f"got {req.n}", "n")
        _check_sequences(server, req)
        if req.prompt_bytes > server.max_prompt_bytes:
            raise protocol.bad(
                f"the prompt has {req.prompt_bytes} bytes, more than {server.max_model_len} "
                "tokens (this model's maximum context length) can hold",
                "messages" if req.kind == "chat" else "prompt")
        prompts = req.prompts if req.kind == "completion" else [None]
        ids_list = await asyncio.to_thread(
            lambda: [_tokenize(server, req, p) for p in prompts])
        _check_prompt_logprobs(server, req, ids_list)
        budgets = [_budget(server, req, len(ids)) for ids in ids_list]
        _check_logprobs(server, req, ids_list, budgets)
        params = [req.sampling_params(b, server.vocab_size) for b in budgets]
        if req.kind == "chat" and req.structured is not None:
            params = [dataclasses.replace(p, structured_outputs=_chat_format(
                server, req, ids_list[0], p.max_tokens)) for p in params]
        # Queued together (one engine iteration takes them all); all or none. Every
        # choice's deltas go to one queue, in the order the engine made them.
        queue = asyncio.Queue()
        added = await server.engine_loop.add(list(zip(ids_list, params, strict=True)),
                                             priority=req.priority, arrival_time=arrival,
                                             slo=req.slo, queue=queue)
        choices = []
        for prompt, ids, handles in zip(prompts, ids_list, added, strict=True):
            for handle in handles:
                choices.append(Choice(len(choices), handle, ids, prompt, server.tokenizer, req,
                                      reasoning=server.reasoning_parser or False,
                                      harmony=server.harmony,
                                      tool_format=server.tool_format))
        return choices
    except APIError:
        server.metrics.rejected.inc(reason="invalid")
        raise
    except NeverFitsError as exc:
        server.metrics.rejected.inc(reason="invalid")
        raise protocol.bad(str(exc), "n" if req.n > 1 else "prompt") from None
    except ValueError as exc:  # the engine's own validation (a grammar that does not
        server.metrics.rejected.inc(reason="invalid")  # compile names its field)
        msg = str(exc)
        param = req.structured_param if msg.startswith("structured_outputs") else None
        raise protocol.bad(msg, param) from None
    except OverloadedError as exc:
        server.metrics.rejected.inc(reason="overloaded")
        raise APIError(503, f"server overloaded: {exc}; retry later",
                       type="server_overloaded", code="overloaded",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except EngineDeadError as exc:
        server.metrics.rejected.inc(reason="engine_dead")
        raise APIError(500, str(exc), type="internal_server_error",
                       code="engine_dead") from None
    except RuntimeError as exc:
        raise APIError(500, str(exc), type="internal_server_error") from None


def _chat_format(server, req, ids: list[int], max_tokens: int):
    """A chat request's output format for this model. Harmony (GPT-OSS): a forced tool
    call is harmony's function-call message, any other format is the final channel's
    text, after about `max_tokens` / 2 tokens of analysis at most (harmony.py).
    Otherwise, with a reasoning parser, it starts after the reasoning block the prompt
    opens (reasoning.grammar_after). A forced tool call is in the model's tool-call
    format (tool_formats.py)."""
    spec = req.structured
    if server.harmony is not None:
        if req.structured_param == "tool_choice":
            return tools.harmony_tool_grammar(req.tools, req.tool_choice, max_tokens)
        return harmony.final_channel_grammar(spec, max_tokens)
    if req.structured_param == "tool_choice":
        try:
            spec = tool_formats.grammar(server.tool_format, req.tools, req.tool_choice,
                                        req.parallel_tool_calls)
        except tools.ToolsError as exc:  # before the engine sees (and compiles) it
            raise protocol.bad(str(exc), exc.param) from None
    if server.reasoning_parser:
        tail = server.tokenizer.decode(ids[-8:], skip_special_tokens=False)
        return reasoning.grammar_after(spec, server.tokenizer, tail)
    return spec


def _check_sequences(server, req) -> None:
    """A 400 for a request of more sequences (prompts x n) than `max_request_seqs`, or
    than an idle server admits at once (`--max-num-seqs` + `--max-waiting`): retrying such
    a request can never succeed, so it is no 503."""
    num_prompts = len(req.prompts) if req.kind == "completion" else 1
    seqs = num_prompts * req.n
    limit, flag = server.max_request_seqs, "--max-request-seqs"
    idle = server.engine_loop.max_request_seqs
    if idle is not None and idle < limit:
        limit, flag = idle, "--max-num-seqs + --max-waiting, what an idle server admits"
    if seqs > limit:
        raise protocol.bad(
            f"this request runs {seqs} sequences ({num_prompts} prompts x n = {req.n}), more "
            f"than this server's limit of {limit} ({flag}); send fewer prompts or a "
            "smaller n", "n" if req.n > 1 else "prompt")


def _check_logprobs(server, req, ids_list: list[list[int]], budgets: list[int]) -> None:
    """A 400 for a request whose log-probabilities, prompt and output together, could
    hold more than `max_logprob_entries` entries (every sample running to its
    `max_tokens`), before anything is queued."""
    prompt = protocol.prompt_logprob_entries(req, [len(ids) for ids in ids_list])
    output = protocol.output_logprob_entries(req, budgets)
    if prompt + output > server.max_logprob_entries:
        raise protocol.bad(
            f"this request may return {prompt + output} log-probability entries ({prompt} "
            f"for its prompts; {output} for its outputs: {sum(budgets)} max_tokens over its "
            f"prompts x n = {req.n} x {(req.logprobs or 0) + 1} entries per token), more "
            f"than this server's limit of {server.max_logprob_entries} (lp-serve "
            "--max-logprob-entries); lower max_tokens, n or the alternatives asked for",
            "logprobs" if output else "prompt_logprobs")


def _check_prompt_logprobs(server, req, ids_list: list[list[int]]) -> None:
    """A 400 for a request whose scored prompts hold more than
    `max_prompt_logprob_entries` entries, before anything is queued."""
    entries = protocol.prompt_logprob_entries(req, [len(ids) for ids in ids_list])
    if entries > server.max_prompt_logprob_entries:
        k = req.scored_prompt()
        param = "prompt_logprobs" if req.prompt_logprobs is not None else "logprobs"
        raise protocol.bad(
            f"this request scores {entries} prompt log-probability entries ("
            f"{sum(len(ids) for ids in ids_list)} prompt tokens x {req.n} samples x "
            f"{k + 1} entries per token), more than this server's limit of "
            f"{server.max_prompt_logprob_entries} (lp-serve --max-prompt-logprob-entries); "
            "send fewer or shorter prompts, or fewer alternatives", param)
