"""OpenAI-compatible HTTP server for the lp_jax engine (aiohttp, server-sent events).

Start it with `lp-serve` (or `python -m lp_jax.serve`); `lp-serve --help` lists the flags.

Endpoints

| method and path | what |
| --- | --- |
| `POST /v1/completions` | text completion; `prompt`: a string, token ids, or up to 256 of them |
| `POST /v1/chat/completions` | chat; `messages` rendered with the model's chat template |
| `GET /v1/models` | the served model name(s), with `max_model_len` (never the model's path) |
| `GET /health` | 200 `{"status": "ok"}`; 503 while draining or once the engine thread died |
| `GET /metrics` | Prometheus text format; names in metrics.py (`--vllm-metric-names`: vLLM's too) |
| `POST /reset_prefix_cache` | drops the prefix cache: 200; 409 while pages are held (vLLM) |
| `POST /tokenize` | vLLM's: a prompt or messages -> `{"count", "max_model_len", "tokens"}` |
| `POST /detokenize` | vLLM's: `{"tokens"}` -> `{"prompt"}` |
| `GET /version` | `{"version": ...}`, lp_jax's (`lp-serve --version` prints it too) |
| `GET`, `POST /ping` | vLLM's liveness probe: as `/health` |

Every route but `/health`, `/ping` and `/version` (and `/metrics` with `--metrics-public`)
needs the API key when one is set (app.py's ROUTES; `lp-serve --help` lists them); an
empty key stops start-up. The tokenizer routes are in vllm_routes.py:
/tokenize gives the ids the completion or chat route would run (`add_special_tokens`,
default true for a prompt and false for messages, as vLLM; `add_generation_prompt`;
`return_token_strs`); a bad field is a 400 naming it. `--chat-template FILE` replaces the
model's chat template (read and checked at start-up: a missing file or a Jinja syntax
error stops it, naming the file and line).

Request fields: `model` (optional; if given it must be a served name, else 404),
`max_tokens` (chat: also `max_completion_tokens`; default: the rest of the context; `prompt
+ max_tokens > max_model_len` is a 400, and so is a prompt of the whole context without it),
`temperature` (0 is greedy, at most 100), `top_p`, `top_k` (-1 or 0 disable it), `seed` (0
to 2**31 - 1, the range the sampler keys on; wider seeds would collide, so they are a 400),
`stop` (a string or up to 16 strings: matched on the detokenized text, the output is cut
before the match and `finish_reason` is "stop"), `stop_token_ids` (up to 64, as vLLM),
`stream`, `stream_options.include_usage`, `n` (up to `--max-n`, default 16, and prompts x n
up to `--max-request-seqs`, default 256: each prompt's samples run as n engine requests, the
later ones after the first's prefill, taking its prompt pages from the prefix cache; choice
`index` = prompt * n + sample; seeded sample i uses `seed + i`), `echo` (completions: the
prompt starts each choice's text and, with `logprobs`, its log-probability object, the first
token's entries null; chat, vLLM's: a final assistant message starts the reply), and the
extensions `prompt_logprobs` (vLLM's: 0 to 20, per prompt token None or `{id: {logprob,
decoded_token}}`; completions: per choice, chat: top level; a request may score at most
`--max-prompt-logprob-entries` entries, default 200,000: prompt tokens x n x (k + 1) over
its prompts, k the alternatives asked for, else a 400 naming the field), `priority` (int,
lower is served first), `ignore_eos`, and the latency objectives `ttft_slo_ms` and
`tbt_slo_ms` (numbers of milliseconds in (0, one day]: time to the first token, largest gap
between two tokens) and `slo_class` (the name of a class from `lp-serve --slo-classes`;
explicit values override the class's). The openai client sends these through `extra_body`.
An unknown class or a bad value is a 400 naming the field, and nothing is queued;
`flowprefill` scheduling orders prefills by TTFT deadline, every policy counts attainment in
`lp:slo_attained_total` / `lp:slo_requests_total`. Sampling, per row inside the compiled
sampler: `logprobs` (completions: an int 0 to 20, OpenAI's legacy object of tokens,
token_logprobs, top_logprobs with the sampled token and the top `logprobs`, as vLLM's, and
text_offset; chat: `logprobs: true` with `top_logprobs` 0 to 20, OpenAI's `content` entries;
the raw model distribution, before penalties, bias and temperature, as vLLM's default;
streamed chunks carry their tokens' entries), `presence_penalty` and `frequency_penalty`
([-2, 2], over output tokens), `repetition_penalty` (> 0, over prompt and output tokens;
vLLM's definitions), `min_tokens` (eos and `stop_token_ids` are masked until that many
tokens), and `logit_bias` (up to 300 {"token id": bias in [-100, 100]}, the ids in ASCII
digits; ids outside the vocabulary are a 400). A request with penalties computes its whole
prompt (no prefix-cache hit): the penalty counts are built on device as its prefill runs. A
request that scores its prompt (`prompt_logprobs`, or `echo` with `logprobs`) computes its
whole prompt too, as vLLM's. `best_of`, `suffix`, `tools`, a `tool_choice` other than "none"
or "auto", non-text `response_format` (both routes) and a completions batch that mixes
strings and token id lists are rejected with 400 and a message naming the field. Unknown
fields are ignored.

Usage: every response carries `usage` (prompt_tokens, each prompt once however many
samples; completion_tokens of every choice; total_tokens; and
`prompt_tokens_details.cached_tokens`: the prompt tokens the prefix cache held for each
prompt's first sample).
When streaming, only with `stream_options: {"include_usage": true}`, as OpenAI sends it: a
final chunk with empty `choices` and `usage`, before `data: [DONE]`; no other chunk carries
`usage`. Streams send one chunk per generated token (its text may be empty while a
multi-byte character or a possible stop string is held back).
Bodies with many entries (log-probabilities, long outputs) are built and encoded on a
worker thread, in pieces (encoding.py), so `/health` and other clients never wait on them.

Bodies are never decompressed: a `Content-Encoding` other than identity is a 415 naming
it (docs/server_limits.md). A request's log-probability entries, prompt and output
together (every sample at its `max_tokens`), may be at most `--max-logprob-entries`
(default 400,000), else a 400 before any work.
The body is read as JSON whatever its Content-Type (`curl -d` sends a form content type);
a body that is not a JSON object is a 400. Strings with a lone UTF-16 surrogate (`"\\ud800"`)
are a 400 naming the field.

Errors use OpenAI's body `{"error": {"message", "type", "param", "code"}}`, aiohttp's own
400s for a malformed request line or header included: 400 for malformed JSON and bad fields,
401 for a missing or wrong API key (`--api-key` or the `LP_API_KEY` environment variable; on
the routes above that need it; the scheme `Bearer` in any case), 404 for an unknown model or
path, 408 for a body that does not arrive within `--read-timeout`, 413 for a body larger
than a prompt of `max_model_len` tokens can use (see app.py), 415 for a compressed body, 503
with `Retry-After` when the request's sequences would take those waiting beyond the free
slots past `--max-waiting` or the server is draining (a request of more sequences than
`--max-num-seqs` + `--max-waiting` is a 400: no retry could succeed), and 500 when the
engine has failed. A stream that fails after its first chunk ends with an error event and
`[DONE]`.

Shutdown: on SIGTERM the server refuses new requests (503), gives those in flight
`--shutdown-grace` seconds to finish, aborts the rest, and exits 0.
"""

from lp_jax.server.app import OpenAIServer
from lp_jax.server.serving import ServerThread, serve

__all__ = ["OpenAIServer", "ServerThread", "serve"]
