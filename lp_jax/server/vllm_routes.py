"""vLLM's endpoints beyond OpenAI's: /version, /ping, /tokenize, /detokenize.

Shaped as vLLM's, so that its clients, probes and scripts work unchanged:

| method and path | answer |
| --- | --- |
| `GET /version` | `{"version": "<lp_jax's version>"}` |
| `GET`, `POST /ping` | as `/health`: 200 `{"status": "ok"}`, 503 draining or dead |
| `POST /tokenize` | `{"count", "max_model_len", "tokens", "token_strs"}` |
| `POST /detokenize` | `{"prompt"}` |

/tokenize takes `{"model", "prompt", "add_special_tokens": true}` or `{"model", "messages",
"add_generation_prompt": true, "add_special_tokens": false}` (the defaults shown; a chat
may carry `tools` and `chat_template_kwargs`, which reach the template), and
/detokenize `{"model", "tokens"}`.
/tokenize gives the ids that /v1/completions runs for that prompt, or /v1/chat/completions
for those messages (the same chat template); `return_token_strs: true` adds each token's
vocabulary string as `token_strs` (else null). /detokenize keeps special tokens, as vLLM's.
`model`, when given, must be a served name (404). A bad field is a 400 naming it. Both
tokenizer routes run the tokenizer on a worker thread and need the API key when one is set;
/ping and /version never do.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from lp_jax.server import protocol, tools
from lp_jax.server.chat import ChatTemplateError


async def version(server, request) -> web.Response:
    from lp_jax.version import lp_jax_version

    return web.json_response({"version": lp_jax_version()})


def _check_model(server, body: dict) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise protocol.bad("'model' must be a string", "model")
    if model:
        protocol.utf8_len(model, "model")
        server.check_model(model)


def _tokenizer(server, param: str):
    if server.tokenizer is None:
        raise protocol.bad("this model has no tokenizer", param)
    return server.tokenizer


async def _body(server, request) -> dict:
    body = protocol.parse_json(await server.read_body(request))
    _check_model(server, body)
    return body


async def tokenize(server, request) -> web.Response:
    body = await _body(server, request)
    has_prompt, has_messages = "prompt" in body, "messages" in body
    if has_prompt == has_messages:
        raise protocol.bad("give either 'prompt' (a string) or 'messages' (a chat), not "
                           f"{'both' if has_prompt else 'neither'}",
                           "prompt" if has_prompt else None)
    strs = protocol.get_bool(body, "return_token_strs", False)
    if has_prompt:
        text = body["prompt"]
        if not isinstance(text, str):
            raise protocol.bad("'prompt' must be a string", "prompt")
        protocol.utf8_len(text, "prompt")
        special = protocol.get_bool(body, "add_special_tokens", True)
        tok = _tokenizer(server, "prompt")
        messages = template_kwargs = tool_list = None
    else:
        messages, _ = protocol.parse_messages(body["messages"])
        gen_prompt = protocol.get_bool(body, "add_generation_prompt", True)
        template_kwargs = protocol.parse_template_kwargs(body)
        try:  # the tools go to the template, as in a chat request
            tool_list = tools.parse_tools(body)[0]
        except tools.ToolsError as exc:
            raise protocol.bad(str(exc), exc.param) from None
        special = protocol.get_bool(body, "add_special_tokens", False)  # the template's
        tok = _tokenizer(server, "messages")

    def run() -> dict:
        try:
            text_ = text if messages is None else server.chat.render(
                messages, gen_prompt, template_kwargs, tool_list)
        except ChatTemplateError as exc:
            raise protocol.bad(str(exc), "messages") from None
        ids = tok.encode_batch([text_], add_special_tokens=special)[0].ids
        return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids,
                "token_strs": [tok.id_to_token(t) for t in ids] if strs else None}

    return web.json_response(await asyncio.to_thread(run))


async def detokenize(server, request) -> web.Response:
    body = await _body(server, request)
    ids = body.get("tokens")
    vocab = server.vocab_size
    if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                          and 0 <= t < vocab for t in ids)):
        raise protocol.bad(f"'tokens' must be a list of token ids in [0, {vocab})", "tokens")
    tok = _tokenizer(server, "tokens")
    text = await asyncio.to_thread(tok.decode, ids, skip_special_tokens=False)
    return web.json_response({"prompt": text})
