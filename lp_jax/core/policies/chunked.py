"""Chunked prefill (Sarathi-Serve): prompts cut along tokens to fill a token budget that
the decodes share, so decodes never stall."""

from __future__ import annotations

from lp_jax.core.config import SchedulerConfig
from lp_jax.core.policies.base import Policy, PrefillPart


class ChunkedPolicy(Policy):
    """Decodes, then in-flight partial prefills, then new requests, within one token
    budget (a data rank's own, under data-parallel attention)."""

    name = "chunked"
    decodes_in_budget = True
    rank_budgets = True

    @staticmethod
    def default_budget(cfg: SchedulerConfig) -> int:
        return 512

    @staticmethod
    def check(cfg: SchedulerConfig) -> None:
        # Under rank budgets a rank's budget holds that rank's decodes only.
        need = cfg.max_decode_rows_per_rank if cfg.rank_budgets else cfg.max_num_seqs
        if cfg.max_num_batched_tokens < need:
            what = (f"a data rank's decodes ({need} of max_num_seqs {cfg.max_num_seqs})"
                    if cfg.rank_budgets else f"max_num_seqs ({cfg.max_num_seqs})")
            raise ValueError(
                f"chunked prefill needs max_num_batched_tokens ({cfg.max_num_batched_tokens}) "
                f">= {what} so all decodes fit the budget"
            )

    def schedule_prefill(self, num_decode: int, admit: bool) -> PrefillPart:
        s = self.sched
        budget = s.prefill_budget()  # the decodes' rows taken out, a rank's on each rank
        chunks = self._continue_partials(budget)
        while admit and (seq := s.admit_head(budget.ranks())) is not None:
            chunks.append(self._admitted_chunk(seq, budget))
        return self._whole_stack(chunks)
