"""The scheduler's configuration: one frozen dataclass, validated at construction.

The engine derives it from its EngineConfig (lp_jax/engine/config.py) and the simulator
from its SimConfig; `policy` is a Policy class, and the fields the policy declares
options for (budget, layer groups, preemption) are checked against it here.
"""

from __future__ import annotations

from dataclasses import dataclass

from lp_jax.core.layer_groups import LayerGroupMode, check_mode
from lp_jax.spec.config import SpeculativeConfig

GRANULARITIES = ("operator", "layer", "group")  # where a preemptible prefill may pause
FLOWPREFILL_RULES = ("reference", "lp_jax")  # FlowPrefill's ranking and batching rules
_POSITIVE_FIELDS = (
    "num_layers max_model_len page_size num_pages vocab_size max_num_seqs max_layer_groups "
    "data_parallel_size"
).split()
@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    # A Policy subclass (lp_jax/core/policies/base.py); `resolve_policy` in
    # lp_jax/core/policies turns a name ("layered") or a dotted path into one.
    policy: type
    num_layers: int
    max_model_len: int
    page_size: int
    num_pages: int
    vocab_size: int
    max_num_seqs: int = 128  # admitted sequences (prefilling + decoding)
    max_num_batched_tokens: int | None = None  # prefill token budget; None: the policy default
    layer_groups: LayerGroupMode = "paper"
    max_layer_groups: int = 16
    eos_token_id: int | None = None
    extra_eos_token_ids: tuple[int, ...] = ()  # more ids that end a completion
    # FlowPrefill (flowprefill.py): segment size of a preemptible prefill, whether a
    # layered batch is preemptible at group boundaries, the batching rule's alpha, and
    # how many paused batches keep their hidden states on device; `flowprefill_rules`:
    # "reference" (the released FlowPrefill code's ranking and batching, default) or
    # "lp_jax" (EDF among infeasible ones too, every member's slack checked).
    # layer_groups="adaptive": each iteration's prefill span is the most layers for which
    # the predicted step (decodes + span) stays within tbt_slo_s * (1 - adaptive_margin);
    # the tightest running request's TBT SLO, if smaller, wins. None: no TBT limit.
    tbt_slo_s: float | None = None
    adaptive_margin: float = 0.1
    preemption_granularity: str = "operator"
    preemptible: bool = False
    slo_alpha: float = 0.1
    flowprefill_rules: str = "reference"
    max_paused_prefills: int = 8
    # FlowPrefill segments dispatched ahead (flowprefill.py "Lookahead"): a plan carries
    # up to this many of the running batch's segments, so at most k + 1 are outstanding
    # on the device; 1: one segment per plan.
    flowprefill_lookahead: int = 1
    # Share KV pages of equal prefixes (block_manager.py). EngineConfig turns it on; off
    # here, so the simulator and the plan-shape tests see whole prefills.
    enable_prefix_caching: bool = False
    # Speculative decoding (lp_jax/spec): drafts verified as k + 1 decode rows; None: off.
    speculative_config: SpeculativeConfig | None = None
    # Data-parallel attention (dp_placement.py): the sequences and the KV pages split over
    # this many ranks, each with num_pages / d pages and ceil(max_num_seqs / d) sequences,
    # and, for a policy with `rank_budgets`, max_num_batched_tokens prefill tokens a step.
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        pol = self.policy
        if not (isinstance(pol, type) and callable(getattr(pol, "schedule_prefill", None))):
            raise ValueError("policy must be a Policy class (lp_jax.core.policies."
                             f"resolve_policy turns a name into one), got {pol!r}")
        for name in _POSITIVE_FIELDS:
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise ValueError(f"{name} must be an int >= 1, got {x!r}")
        check_mode(self.layer_groups)
        if self.num_pages % self.data_parallel_size:
            raise ValueError(f"num_pages {self.num_pages} must split evenly over "
                             f"data_parallel_size {self.data_parallel_size} ranks")
        if self.tbt_slo_s is not None and not (isinstance(self.tbt_slo_s, int | float)
                                               and 0 < self.tbt_slo_s < 86400):
            raise ValueError(f"tbt_slo_s must be a positive number of seconds, got "
                             f"{self.tbt_slo_s!r}")
        if isinstance(self.adaptive_margin, bool) or not isinstance(
                self.adaptive_margin, int | float) or not 0 <= self.adaptive_margin < 1:
            raise ValueError(f"adaptive_margin must be in [0, 1), got {self.adaptive_margin!r}")
        if self.layer_groups == "adaptive" and (not pol.adaptive_groups or self.preemptible):
            raise ValueError(f'layer_groups="adaptive" is for a policy that declares '
                             f"adaptive_groups (layered), not preemptible; got {self.name}")
        if self.preemption_granularity not in GRANULARITIES:
            raise ValueError(f"preemption_granularity must be one of {GRANULARITIES}, "
                             f"got {self.preemption_granularity!r}")
        if self.flowprefill_rules not in FLOWPREFILL_RULES:
            raise ValueError(f"flowprefill_rules must be one of {FLOWPREFILL_RULES}, "
                             f"got {self.flowprefill_rules!r}")
        for name in ("preemptible", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.preemptible and pol.preemptible_policy is None:
            raise ValueError(f"preemptible applies to a policy that declares a "
                             f"preemptible_policy (layered; flowprefill always is), not "
                             f"{self.name}")
        if isinstance(self.slo_alpha, bool) or not isinstance(self.slo_alpha, int | float) \
                or not 0 <= self.slo_alpha < 1:
            raise ValueError(f"slo_alpha must be in [0, 1), got {self.slo_alpha!r}")
        if isinstance(self.max_paused_prefills, bool) or not isinstance(
                self.max_paused_prefills, int) or self.max_paused_prefills < 0:
            raise ValueError(
                f"max_paused_prefills must be an int >= 0, got {self.max_paused_prefills!r}")
        if isinstance(self.flowprefill_lookahead, bool) or not isinstance(
                self.flowprefill_lookahead, int) or self.flowprefill_lookahead < 1:
            raise ValueError(f"flowprefill_lookahead must be an int >= 1, got "
                             f"{self.flowprefill_lookahead!r}")
        for name, ids in (("eos_token_id", (self.eos_token_id,)),
                          ("extra_eos_token_ids", self.extra_eos_token_ids)):
            bad = [t for t in ids if t is not None and not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"{name} {bad[0]} outside [0, {self.vocab_size})")
        if self.max_num_batched_tokens is None:
            budget = self.policy_class.default_budget(self)
            object.__setattr__(self, "max_num_batched_tokens", budget)
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        sc = self.speculative_config
        if sc is not None and not isinstance(sc, SpeculativeConfig):
            raise ValueError(f"speculative_config must be a SpeculativeConfig, got {sc!r}")
        self.policy_class.check(self)

    @property
    def max_seqs_per_rank(self) -> int:
        """Sequences one data rank admits at most: ceil(max_num_seqs / d)."""
        return -(-self.max_num_seqs // self.data_parallel_size)

    @property
    def max_decode_rows_per_rank(self) -> int:
        """Decode rows one rank runs in a step at most: one a sequence it holds, or with
        speculation max_num_seqs (verification rows are capped over all ranks only)."""
        return self.max_num_seqs if self.speculative_config is not None \
            else self.max_seqs_per_rank

    @property
    def rank_budgets(self) -> bool:
        """Whether max_num_batched_tokens is each data rank's own prefill budget
        (budget.py): under data-parallel attention, for a policy that declares
        `rank_budgets`; else one budget holds the whole plan."""
        return self.data_parallel_size > 1 and getattr(self.policy_class, "rank_budgets", False)

    @property
    def policy_class(self) -> type:
        """The policy that runs: a preemptible layered batch runs FlowPrefill's rules."""
        return self.policy.preemptible_policy if self.preemptible else self.policy

    @property
    def name(self) -> str:
        """The configured policy's name, for logs and stats."""
        return self.policy.name or self.policy.__name__
