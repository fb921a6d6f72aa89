"""The program family a scheduler config needs: its row buckets and hidden buffer.

The step is compiled once per row bucket (lp_jax/executor/step.py). A call of n rows runs
in the smallest bucket >= n; the largest call a plan makes is the policy's `step_rows`
(its prefill plus, unless decodes share its budget, every decode), and the buckets must
reach it. A policy may declare its own bucket rule (`Policy.token_buckets`); the default
is `default_token_buckets`. The engine, `python -m lp_jax.aot` and the benchmarks all
size programs here, so they agree.
"""

from __future__ import annotations

from lp_jax.core.config import SchedulerConfig

# Below _POW4_UP_TO rows a step reads every weight whatever its row count (far under the
# ridge point of any chip: lp_jax.roofline), so buckets grow 4x there: padding costs
# almost nothing, and each bucket saved is a program less to compile at start-up.
_POW4_UP_TO = 64
_POW2_UP_TO = 512  # buckets double up to here, then grow by 1.5x (padding <= 1.5x)


def default_token_buckets(max_rows: int, *, min_rows: int = 1) -> tuple[int, ...]:
    """Row buckets: 1, 4, 16, 64, then powers of two up to 512, then alternately x1.5 and
    x4/3 (768, 1024, 1536, 2048, ...), with max_rows itself last. Padding stays under 4x
    up to 64 rows (weight-bound steps), under 2x up to 512 and under 1.5x above, where
    padded rows cost compute; the count grows with log(max_rows) only: 16 buckets for an
    8192-token layered budget."""
    out, b = [], min_rows
    while b < max_rows:
        out.append(b)
        if b < _POW4_UP_TO:
            b = min(4 * b, _POW4_UP_TO)
        elif b < _POW2_UP_TO:
            b *= 2
        else:
            b = b * 3 // 2 if b & (b - 1) == 0 else b * 4 // 3
    return (*out, max_rows)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} rows exceed the largest compiled bucket {buckets[-1]}")


def step_buckets(cfg: SchedulerConfig, token_buckets=None) -> tuple[int, ...]:
    """The row buckets: `token_buckets` if given, else the policy's rule; checked to
    cover the policy's largest call. Raises ValueError, before anything is compiled."""
    policy = cfg.policy_class
    rows = policy.step_rows(cfg)
    buckets = tuple(token_buckets) if token_buckets else policy.token_buckets(cfg)
    if buckets[-1] < rows:
        decodes = "" if policy.decodes_in_budget else f" next to {cfg.max_num_seqs} decodes"
        raise ValueError(
            f"token_buckets {buckets} must reach {rows} rows: the {cfg.name} policy runs up "
            f"to {policy.max_prefill_tokens(cfg)} prefill tokens{decodes}")
    return buckets


def hidden_rows(cfg: SchedulerConfig) -> int:
    """Rows of the carried-hidden buffer: [0, max_num_seqs) carries decode rows between a
    step's calls, then `hidden_slots` areas of max_num_batched_tokens rows each, where
    prefill batches that span several plans (layered groups, FlowPrefill segments, paused
    batches) keep their hidden states (StepPlan.prefill_rows). Under data ranks' own
    budgets (`cfg.rank_budgets`) these are one rank's rows: the buffer holds one such
    block a rank, split over the ranks (`StepSpec.hidden_split`)."""
    return cfg.max_num_seqs + cfg.max_num_batched_tokens * cfg.policy_class.hidden_slots(cfg)
