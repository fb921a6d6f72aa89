"""Orca: whole prompts next to the decodes (decodes stall behind long prompts)."""

from __future__ import annotations

from lp_jax.core.config import SchedulerConfig
from lp_jax.core.policies.base import Policy, PrefillPart


class OrcaPolicy(Policy):
    """Whole prompts while they fit the budget; always at least one, so a prompt longer
    than the budget runs alone and a plan may carry max_model_len prompt tokens."""

    name = "orca"

    @staticmethod
    def default_budget(cfg: SchedulerConfig) -> int:
        return cfg.max_model_len

    @staticmethod
    def max_prefill_tokens(cfg: SchedulerConfig) -> int:
        return max(cfg.max_num_batched_tokens, cfg.max_model_len)

    def schedule_prefill(self, num_decode: int, admit: bool) -> PrefillPart:
        s, left, chunks = self.sched, self.sched.config.max_num_batched_tokens, []
        while admit and s.waiting and not (chunks and self._uncached(s.waiting[0]) > left):
            seq = s.admit_head()
            if seq is None:
                break
            chunks.append(self._admitted_chunk(seq, seq.prefill_target))
            left -= chunks[-1].num_tokens
        return self._whole_stack(chunks)
