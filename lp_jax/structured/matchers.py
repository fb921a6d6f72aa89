"""The constrained sequences' matchers, and the bitmask rows of a step's samples.

`StructuredOutputs` holds one llguidance matcher per constrained sequence (by seq id),
made when the engine admits the request, advanced with each token the scheduler commits
for it (`advance`), dropped when it finishes or is aborted (`release`). The model runner
asks it for the bitmask rows of a call's sampled rows (`fill`); everything else about a
step is untouched, so rows without a grammar cost nothing here. A spec with `start_after`
ids (the end of a reasoning block) leaves its rows free until the output has them: the
matcher sees only the tokens after.

The mask of a sequence's next token needs its previous token committed: the scheduler
holds a constrained sequence out of the plan it makes while that token is still on device
(scheduler.py `_advance`), so `fill` always reads a matcher that has seen every token
before the one it masks. `stats` counts the host time of both halves (seconds), the
per-token cost BENCHMARKS.md reports.
"""

from __future__ import annotations

import os
import time

import llguidance
import numpy as np

from lp_jax.structured.compiler import GrammarCompiler
from lp_jax.structured.params import StructuredOutputsParams, mask_words


class StructuredOutputs:
    def __init__(self, compiler: GrammarCompiler, *, threads: int | None = None):
        self.compiler = compiler
        self.words = mask_words(compiler.vocab_size)
        self._matchers: dict[int, llguidance.LLMatcher] = {}
        # seq_id -> (start_after ids, its recent output ids): free rows until they appear
        self._waiting: dict[int, tuple[tuple[int, ...], list[int]]] = {}
        # Mask rows are filled in parallel (llguidance drops the GIL) past a few rows.
        self._executor = llguidance.LLExecutor(threads or max(1, min(8, os.cpu_count() or 1)))
        self.stats = {"advanced": 0, "advance_s": 0.0, "filled": 0, "fill_s": 0.0,
                      "rejected": 0}

    def __len__(self) -> int:
        return len(self._matchers)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._matchers

    def waiting(self, seq_id: int) -> bool:
        """Whether seq's grammar has not started yet (its start_after ids not seen)."""
        return seq_id in self._waiting

    def check(self, spec: StructuredOutputsParams) -> None:
        """Compiles spec (cached); ValueError naming the problem if it does not compile."""
        self.compiler.compile(spec)

    def add(self, seq_id: int, spec: StructuredOutputsParams) -> None:
        self._matchers[seq_id] = self.compiler.matcher(spec)
        if spec.start_after:
            self._waiting[seq_id] = (spec.start_after, [])

    def release(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)
        self._waiting.pop(seq_id, None)

    def advance(self, seq_id: int, token: int) -> None:
        """The committed token joins its sequence's matcher. A token the grammar refuses
        (only possible when the mask was not applied) leaves the matcher in its error
        state, whose mask then allows only eos: the sequence ends at its next token."""
        m = self._matchers.get(seq_id)
        if m is None:
            return
        wait = self._waiting.get(seq_id)
        if wait is not None:  # the grammar starts with the token after the trigger
            trigger, recent = wait
            recent.append(token)
            del recent[: -len(trigger)]
            if tuple(recent) == trigger:
                del self._waiting[seq_id]
            return
        t0 = time.perf_counter()
        ok = m.consume_token(token)
        self.stats["advance_s"] += time.perf_counter() - t0
        self.stats["advanced"] += 1
        self.stats["rejected"] += not ok

    def fill(self, rows: list[tuple[int, int]], out_SW: np.ndarray) -> None:
        """Fills row r of out_SW with the allowed next tokens of seq_id, for each
        (seq_id, r) whose grammar has started; other rows are left as they are."""
        if (out_SW.dtype != np.int32 or not out_SW.flags.c_contiguous
                or out_SW.shape[1] != self.words):
            raise ValueError(f"bitmask must be C-contiguous int32 [S, {self.words}], got "
                             f"{out_SW.dtype} {out_SW.shape}")
        t0 = time.perf_counter()
        todo = [(self._matchers[sid], r) for sid, r in rows if sid not in self._waiting]
        if len(todo) == 1:
            m, r = todo[0]
            row = out_SW[r]
            m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        elif todo:
            self._executor.unsafe_compute_mask_ptr(todo, out_SW.ctypes.data,
                                                   out_SW.shape[1] * 4, out_SW.shape[0])
        self.stats["fill_s"] += time.perf_counter() - t0
        self.stats["filled"] += len(todo)

    def fill_after(self, rows: list[tuple[int, int, tuple[int, ...]]],
                   out_SW: np.ndarray) -> None:
        """Fills row r of out_SW with seq_id's allowed tokens after `prefix`, tokens not
        committed yet (a verification row after its drafts): the matcher consumes them,
        computes the mask, and rolls them back. A prefix the grammar refuses part-way
        makes a row no accepted run reaches (the refused draft is masked at its own row,
        so it is rejected there); it gets the mask where the refusal happened."""
        t0 = time.perf_counter()
        for sid, r, prefix in rows:
            m, post = self._matchers[sid], list(prefix)
            wait = self._waiting.get(sid)
            if wait is not None:  # the grammar starts after the trigger, if prefix has it
                trigger, recent = wait
                recent, post = list(recent), None
                for i, t in enumerate(prefix):
                    recent = (recent + [t])[-len(trigger):]
                    if tuple(recent) == trigger:
                        post = list(prefix[i + 1:])
                        break
                if post is None:
                    continue  # still free: the row stays as it is
            n = m.try_consume_tokens(post) if post else 0
            row = out_SW[r]
            m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            if n:
                m.rollback(n)
        self.stats["fill_s"] += time.perf_counter() - t0
        self.stats["filled"] += len(rows)
