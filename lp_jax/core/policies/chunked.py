"""Chunked prefill (Sarathi-Serve): prompts cut along tokens to fill a token budget that
the decodes share, so decodes never stall."""

from __future__ import annotations

from lp_jax.core.config import SchedulerConfig
from lp_jax.core.policies.base import Policy, PrefillPart


class ChunkedPolicy(Policy):
    """Decodes, then in-flight partial prefills, then new requests, within one token budget."""

    name = "chunked"
    decodes_in_budget = True

    @staticmethod
    def default_budget(cfg: SchedulerConfig) -> int:
        return 512

    @staticmethod
    def check(cfg: SchedulerConfig) -> None:
        if cfg.max_num_batched_tokens < cfg.max_num_seqs:
            raise ValueError(
                f"chunked prefill needs max_num_batched_tokens ({cfg.max_num_batched_tokens}) "
                f">= max_num_seqs ({cfg.max_num_seqs}) so all decodes fit the budget"
            )

    def schedule_prefill(self, num_decode: int, admit: bool) -> PrefillPart:
        s = self.sched
        chunks, left = self._continue_partials(s.config.max_num_batched_tokens - num_decode)
        while admit and left > 0 and (seq := s.admit_head()) is not None:
            chunks.append(self._admitted_chunk(seq, left))
            left -= chunks[-1].num_tokens
        return self._whole_stack(chunks)
