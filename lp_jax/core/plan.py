"""What one iteration must compute: the plan the scheduler hands to an executor.

An executor (the JAX model runner, or a simulator's cost model) carries out a `StepPlan` and
returns a `StepResult`: one sampled token per sequence that samples, the log-probabilities
asked for, and what the step cost; the scheduler's `commit(plan, result, now)` alone
applies it to the sequences. Plans say which tokens run through which layers and nothing
about devices, arrays or padding.

Every plan has two parts:
- `decode`: sequences that each run their last token through all layers and sample one token;
  a speculating one (`drafts`, lp_jax/spec) runs its k draft tokens after it too, k + 1
  verification rows, and gets its accepted drafts and one more token;
- `prefill`: prompt chunks that run through operator units [unit_start, unit_end) only
  (layers [layer_start, layer_end)). Orca and
  chunked prefill always use the whole stack (one group). Layered prefill runs the same chunks
  for G consecutive iterations, group g in iteration g; the executor keeps the batch's hidden
  states between them under `prefill_batch_id`, embeds the tokens when `is_first_group`, and
  computes logits for the chunks that `samples` when `is_last_group`.

Preemptible prefill (FlowPrefill, flowprefill.py) runs a batch in segments that may end
inside a layer, which operator units (unit 2i is layer i's attention half, 2i + 1 its
MLP half) express; a layered group g is units [2a, 2b) for its layers [a, b). A
batch's carried hidden states live in the executor's hidden buffer at `prefill_rows` (the
first row of each chunk; default: packed from 0), so a paused batch keeps its rows while
another runs, and dropping one chunk does not move the others.

Plans hold the live `Sequence` objects, so an executor reads token ids, positions
(`num_tokens - 1` for a decode, [start, end) for a chunk) and page ids before `commit`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lp_jax.core.sequence import Sequence


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """Tokens [start, end) of `seq` in this prefill batch."""

    seq: Sequence
    start: int
    end: int
    # True iff this chunk ends the sequence's prefill, so its next token is sampled after the
    # chunk's last layer. Fixed at construction: the sequence may be preempted much later.
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end <= self.seq.prefill_target:
            raise ValueError(
                f"chunk [{self.start}, {self.end}) outside the prefill target "
                f"{self.seq.prefill_target} of seq {self.seq.seq_id}"
            )
        object.__setattr__(self, "samples", self.end == self.seq.prefill_target)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class StepPlan:
    step_id: int
    num_layers: int
    decode: tuple[Sequence, ...] = ()
    prefill: tuple[PrefillChunk, ...] = ()
    prefill_batch_id: int | None = None  # set iff prefill is non-empty
    # The prefill span in operator units (2i: layer i's attention half, 2i + 1 its MLP
    # half); unit_end None: 2 * num_layers, the whole stack. layer_start / layer_end are
    # the layers it touches.
    unit_start: int = 0
    unit_end: int | None = None
    group_index: int = 0
    num_groups: int = 1
    prefill_rows: tuple[int, ...] = ()  # hidden-buffer row of each chunk; (): packed from 0
    # The draft tokens each decode verifies, in decode order (() for one without); ():
    # none speculates.
    drafts: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "decode", tuple(self.decode))
        set_(self, "drafts", tuple(tuple(d) for d in self.drafts))
        if self.drafts and len(self.drafts) != len(self.decode):
            raise ValueError("drafts needs one entry per decode")
        set_(self, "prefill", tuple(self.prefill))
        set_(self, "prefill_rows", tuple(self.prefill_rows))
        units = 2 * self.num_layers
        if self.unit_end is None:
            set_(self, "unit_end", units)
        if not 0 <= self.unit_start < self.unit_end <= units:
            raise ValueError(f"unit range [{self.unit_start}, {self.unit_end}) not inside "
                             f"[0, {units})")
        if not 0 <= self.group_index < self.num_groups <= units:
            raise ValueError(f"group {self.group_index} of {self.num_groups} is invalid")
        if self.num_groups == 1 and (self.unit_start, self.unit_end) != (0, units):
            raise ValueError("a single-group plan must cover all layers")
        if self.prefill_rows and len(self.prefill_rows) != len(self.prefill):
            raise ValueError("prefill_rows needs one row per prefill chunk")
        if (self.prefill_batch_id is None) != (not self.prefill):
            raise ValueError("prefill_batch_id must be set iff the plan has prefill chunks")
        ids = [s.seq_id for s in self.decode] + [c.seq.seq_id for c in self.prefill]
        if len(set(ids)) != len(ids):
            raise ValueError(f"a sequence appears twice in plan {self.step_id}: {ids}")

    @property
    def layer_start(self) -> int:
        """The first layer the prefill span touches."""
        return self.unit_start // 2

    @property
    def layer_end(self) -> int:
        """One past the last layer the prefill span touches."""
        return -(-self.unit_end // 2)

    @property
    def is_first_group(self) -> bool:
        """The prefill tokens are embedded in this plan (its span starts at unit 0)."""
        return self.unit_start == 0

    @property
    def is_last_group(self) -> bool:
        """The prefill span ends the stack, so completed prompts sample now."""
        return self.unit_end == 2 * self.num_layers

    @property
    def chunk_rows(self) -> tuple[int, ...]:
        """Hidden-buffer row of each chunk's first token (packed from 0 by default)."""
        if self.prefill_rows:
            return self.prefill_rows
        rows, r = [], 0
        for c in self.prefill:
            rows.append(r)
            r += c.num_tokens
        return tuple(rows)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefill)

    @property
    def num_decode_tokens(self) -> int:
        return len(self.decode)

    @property
    def num_decode_rows(self) -> int:
        """Rows the decodes run: one each, plus their drafts (verification rows)."""
        return len(self.decode) + sum(map(len, self.drafts))

    @property
    def drafts_by_seq(self) -> dict[int, tuple[int, ...]]:
        """{seq_id: its drafts} for the decodes that speculate in this plan."""
        if not self.drafts:
            return {}
        return {s.seq_id: d for s, d in zip(self.decode, self.drafts, strict=True) if d}

    @property
    def phase(self) -> str:
        if self.prefill and self.decode:
            return "hybrid"
        return "prefill" if self.prefill else "decode" if self.decode else "idle"

    @property
    def sampling_seqs(self) -> tuple[Sequence, ...]:
        """Sequences that get a token from this iteration: decodes, then completed prefills."""
        done = tuple(c.seq for c in self.prefill if c.samples) if self.is_last_group else ()
        return self.decode + done


@dataclass(frozen=True, slots=True)
class StepResult:
    """What an executor returns for one plan (collected on the host).

    `tokens`: the sampled token of each of the plan's sampling sequences (by seq_id);
    `accepted`: a speculating decode's drafts that verification accepted, which come
    before its token (absent: none); `logprobs`: {token_id: logprob} of the sampled token
    and the top alternatives, for the sequences that asked (`accepted_logprobs`: one
    such dict per accepted draft); `prompt_logprobs`: (seq_id, position, {token_id: logprob}) for
    each prompt position the step scored; `experts_activated`: per call of the step,
    summed over its layers, with `prefill_call` the call that ran the prefill group;
    `dispatched_at` / `collected_at`: perf_counter times (0.0 where not measured)."""

    tokens: dict[int, int] = field(default_factory=dict)
    logprobs: dict[int, dict[int, float]] = field(default_factory=dict)
    accepted: dict[int, tuple[int, ...]] = field(default_factory=dict)
    accepted_logprobs: dict[int, tuple[dict[int, float], ...]] = field(default_factory=dict)
    # A draft model's proposals for each sampling sequence's next decode (EAGLE-3).
    next_drafts: dict[int, tuple[int, ...]] = field(default_factory=dict)
    prompt_logprobs: tuple[tuple[int, int, dict[int, float]], ...] = ()
    experts_activated: tuple[int, ...] = ()
    prefill_call: int | None = None
    dispatched_at: float = 0.0
    collected_at: float = 0.0

    @property
    def prefill_experts(self) -> int:
        """Experts the prefill group's call activated (0 without prefill)."""
        return 0 if self.prefill_call is None else self.experts_activated[self.prefill_call]
