"""Orca: whole prompts next to the decodes (decodes stall behind long prompts)."""

from __future__ import annotations

from lp_jax.core.config import SchedulerConfig
from lp_jax.core.policies.base import Policy, PrefillPart


class OrcaPolicy(Policy):
    """Whole prompts while they fit the budget (a data rank's, under data-parallel
    attention); always at least one, so a prompt longer than the budget runs alone (on its
    rank) and a plan may carry max_model_len prompt tokens (a rank)."""

    name = "orca"
    rank_budgets = True

    @staticmethod
    def default_budget(cfg: SchedulerConfig) -> int:
        return cfg.max_model_len

    @staticmethod
    def max_prefill_tokens(cfg: SchedulerConfig) -> int:
        return max(cfg.max_num_batched_tokens, cfg.max_model_len)

    def schedule_prefill(self, num_decode: int, admit: bool) -> PrefillPart:
        s, budget, chunks = self.sched, self.sched.prefill_budget(), []
        while admit and s.waiting:
            seq = s.admit_head(budget.ranks(s.waiting[0]))
            if seq is None:
                break
            chunks.append(self._admitted_chunk(seq, budget, whole=True))
        return self._whole_stack(chunks)
