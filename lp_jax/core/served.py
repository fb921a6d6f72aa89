"""The narrow interface between an engine and the server that drives it.

The HTTP server (lp_jax/server/) sees an engine only through `ServedEngine`: its limits,
its queue state, add, abort, step and stats. It never reads the scheduler's lists, so a
test double (server/mock.py's MockEngine) implements these few members and nothing more,
and the scheduler may change its queues without the server noticing. LLMEngine implements
it too; tests/test_server_mock.py runs the server on an engine that exposes only these
members.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What an engine can ever take: `max_model_len` tokens per sequence (prompt and
    output), `max_num_seqs` sequences admitted at once, token ids below `vocab_size`."""

    max_model_len: int
    max_num_seqs: int
    vocab_size: int


@dataclass(frozen=True, slots=True)
class QueueState:
    """The engine's queues after its last step. `running`: sequences admitted (decoding or
    prefilling); `waiting_ids`: sequences added and not yet admitted (queued, or held until
    an earlier sample's prefill); `idle_steps`: steps so far that did no work (a driver
    that sees this grow without outputs is polling a stuck engine)."""

    running: int
    waiting_ids: frozenset[int]
    idle_steps: int

    @property
    def waiting(self) -> int:
        return len(self.waiting_ids)


@runtime_checkable
class ServedEngine(Protocol):
    """An engine the server can serve. Every method runs on one thread (the server's
    engine thread); `limits`, `tokenizer`, `model_dir` and `slo_classes` are fixed at
    construction and may be read from any thread.

    `add_request(prompt_ids, params, *, priority, arrival_time, slo=None,
    prefill_after=None, index=0) -> id` queues one sequence (ValueError: bad input);
    `abort(id)` frees its pages; `step()` runs one iteration and returns the outputs
    (`request_id`, `new_token_ids`, `finished`, `finish_reason`, `prompt_token_ids`,
    `metrics`, ...) of the sequences it advanced or finished; `stats()` is a dict of
    counters (free_pages, total_pages, iterations, ...); `resolve_slo(fields)` turns a
    request's SLO fields into what `add_request(slo=...)` takes (ValueError: unknown)."""

    tokenizer: object
    model_dir: str | None
    slo_classes: dict

    @property
    def limits(self) -> EngineLimits: ...

    def queue_state(self) -> QueueState: ...

    def add_request(self, prompt, sampling_params=None, *, priority: int = 0,
                    arrival_time: float | None = None, slo=None,
                    prefill_after: int | None = None, index: int = 0) -> int: ...

    def abort(self, request_id: int) -> bool: ...

    def step(self) -> list: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> dict: ...

    def reset_prefix_cache(self) -> bool: ...

    def resolve_slo(self, slo): ...
