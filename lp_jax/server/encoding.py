"""JSON out of the server: small bodies on the event loop, big ones on a worker thread.

A response with prompt log-probabilities may hold `--max-prompt-logprob-entries` entries
(200,000 by default, about 12 MB of JSON): building it (a tokenizer decode per distinct
token) and encoding it take long enough to stall every other client, `/health` included,
if the event loop does it. `render` runs such a body's builder on a worker thread.

A thread alone is not enough: one `json.dumps` call holds the GIL until it returns, so the
event loop would still wait for the whole encoding. `json_text` encodes a list of containers
an element at a time (a row of log-probabilities in one C call), and the GIL changes hands
between them.
"""

from __future__ import annotations

import asyncio
import json

# Entries (tokens, log-probability entries) above which a body is built off the event loop.
BIG_BODY_ENTRIES = 4096


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(text: str) -> bytes:
    """One server-sent event carrying `text` (a JSON document)."""
    return f"data: {text}\n\n".encode()


def json_text(obj) -> str:
    """`dumps(obj)` (string keys), encoded in pieces: a dict that holds a list is written
    item by item, a list that holds containers element by element; anything else (a
    log-probability row, a list of numbers) in one call. The same text as `dumps`."""
    if isinstance(obj, dict) and any(isinstance(v, list) for v in obj.values()):
        return "{" + ",".join(f"{dumps(k)}:{json_text(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, list) and len(obj) > 1 and any(isinstance(v, dict | list) for v in obj):
        return "[" + ",".join(json_text(v) for v in obj) + "]"
    return dumps(obj)


async def render(build, *, big: bool) -> str:
    """The JSON text of `build()`: on the event loop, or, when `big`, built and encoded on
    a worker thread (`build` must then touch nothing another coroutine changes meanwhile)."""
    if not big:
        return dumps(build())
    return await asyncio.to_thread(lambda: json_text(build()))
