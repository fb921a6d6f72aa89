"""The compiled program set stays small: one program per row bucket, whatever the policy.

Start-up is part of the product: default arguments must start on any checkpoint, with at
most 32 backend compilations per engine (every one counted: loading, the KV pool, the step
programs; XLA:CPU maps ~500 memory regions per program, and a process holding ~120
programs aborts), and no program count that grows with the layer count or the number of
layer groups.

A new feature must add rows to the buckets or per-row inputs, not new program keys.
"""

import re

import numpy as np
import pytest
from conftest import make_sched_cfg
from conftest import make_seq as _seq

from lp_jax import LLM, SamplingParams
from lp_jax.core.layer_groups import split_layers
from lp_jax.core.plan import PrefillChunk, StepPlan
from lp_jax.core.programs import default_token_buckets, step_buckets


def buckets_for(policy: str, budget: int, max_num_seqs: int) -> tuple[int, ...]:
    """The default row buckets of a policy at this budget (any model)."""
    return step_buckets(make_sched_cfg(policy, max_num_batched_tokens=budget,
                                       max_num_seqs=max_num_seqs))

MAX_PROGRAMS = 32


def test_default_engine_starts_and_serves_every_sampling_feature(tiny_dir):
    """The tiny checkpoint has max_position_embeddings 512, so its defaults are
    max_model_len 512 and a layered budget of 512 (the policy's 8192, capped at the
    context: default_prefill_budget). With the old (prefill x decode x group) keys a
    default layered engine (the policy with the most programs: the budget's prompt rows
    next to max_num_seqs decodes) compiled 104+ programs and aborted the process; now it
    compiles one program per row bucket, at most 32 (the count tests below cover every
    budget up to 16384), shows its progress and a ready line, and reproduces the Hugging
    Face golden tokens without compiling while serving. Then every per-request sampling
    feature at once (log-probabilities, prompt log-probabilities, n = 2, the three
    penalties, logit_bias, min_tokens with a stop id) runs in the same programs: the
    golden greedy tokens again (penalties this small and a zero bias keep them, while
    still running the count state, the bias rows and the log-probability outputs), and
    still no compile. Several default engines alive in one process, with their start-up
    times, are `python launch/bench_programs.py` (BENCHMARKS.md)."""
    golden = np.load("tests/golden/tiny.npz")
    prompts = [golden[f"prompt_{i}"].tolist() for i in range(3)]
    want = [golden[f"greedy_{i}"].tolist() for i in range(3)]
    lines = []
    llm = LLM(tiny_dir, log=lines.append, scheduling="layered")
    stats = llm.stats()
    sched = llm.engine.scheduler.config
    assert sched.max_model_len == 512 and sched.max_num_batched_tokens == 512
    assert stats["programs"] == len(buckets_for("layered", 512, sched.max_num_seqs))
    # start-up a person can watch: progress while compiling, then one "ready" line
    done = [int(m.group(1)) for m in map(re.compile(r"compiled (\d+)/(\d+) programs").match,
                                           lines) if m]
    assert done and done == sorted(done) and done[-1] == stats["programs"], lines
    ready = lines[-1]
    assert ready.startswith("ready in ") and f"{stats['programs']} programs" in ready, ready
    assert "policy layered" in ready and "KV" in ready and "weights" in ready, ready
    assert stats["programs"] <= stats["startup_compilations"] <= MAX_PROGRAMS, stats
    plain = SamplingParams(temperature=0.0, max_tokens=len(want[0]), ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=plain)
    assert [o.token_ids for o in outs] == want
    unused = next(t for t in range(1000) if all(t not in w for w in want))
    params = SamplingParams(
        temperature=0.0, max_tokens=len(want[0]), ignore_eos=True, logprobs=5,
        presence_penalty=1e-6, frequency_penalty=1e-6, repetition_penalty=1 + 1e-6,
        logit_bias={0: 0.0}, min_tokens=len(want[0]), stop_token_ids=[unused],
        prompt_logprobs=5, n=2)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [[s.token_ids for s in o.outputs] for o in outs] == [[w, w] for w in want]
    assert all(len(o.logprobs) == len(w) for o, w in zip(outs, want, strict=True))
    assert all(len(o.prompt_logprobs) == len(p) for o, p in zip(outs, prompts, strict=True))
    assert llm.stats()["compilations_after_warmup"] == 0


@pytest.mark.parametrize("max_num_seqs", [8, 32, 128, 256])
@pytest.mark.parametrize("budget", [256, 512, 2048, 8192, 16384])
def test_program_count_is_bounded_and_layered_close_to_chunked(budget, max_num_seqs):
    """Counts for any model (they depend on the budget and max_num_seqs only; the layer
    count and G never enter): at most 32 (beside ~2 start-up compiles), and layered within
    1.5x chunked at the same budget and max_num_seqs."""
    if budget < max_num_seqs:
        pytest.skip("chunked needs a budget of at least max_num_seqs")  # a config error
    chunked = len(buckets_for("chunked", budget, max_num_seqs))
    layered = len(buckets_for("layered", budget, max_num_seqs))
    assert layered <= MAX_PROGRAMS - 4 and layered <= 1.5 * chunked
    # FlowPrefill's segments (any unit span) and paused batches add no program key
    assert len(buckets_for("flowprefill", budget, max_num_seqs)) == layered


def test_default_buckets_bound_padding():
    buckets = default_token_buckets(8224)
    assert buckets[:5] == (1, 4, 16, 64, 128) and buckets[-1] == 8224 and len(buckets) == 16
    for n in range(1, 8225):
        b = next(b for b in buckets if n <= b)
        assert b < 4 * n
        if n > 64:
            assert b < 2 * n or b == n
        if n > 512:
            assert b <= 1.5 * n


@pytest.mark.parametrize("group", [0, 1, 3])
def test_a_layered_plan_becomes_calls_over_its_group(group):
    """Decode rows cross layers [0, a) and [b, L) alone, and join the prefill rows in the
    group [a, b): no prefill row is carried through a layer it does not need."""
    from lp_jax.executor.model_runner import ModelRunner

    L, G = 8, 4
    a, b = split_layers(L, G)[group]
    chunks = (PrefillChunk(_seq(0, 100), 0, 100),)
    decode = (_seq(1, 5, decoding=True), _seq(2, 9, decoding=True))
    plan = StepPlan(0, L, decode, chunks, prefill_batch_id=0, unit_start=2 * a, unit_end=2 * b,
                    group_index=group, num_groups=G)
    runner = object.__new__(ModelRunner)  # only the host-side planning, no model
    runner.L = L
    runner.spec = type("Spec", (), {"max_num_seqs": 4, "hidden_split": False})()
    calls, mixed = runner._plan_calls(plan, None)
    units = [c.units for c in calls]
    expected = ([(0, 2 * a)] if a else []) + [(2 * a, 2 * b)] + ([(2 * b, 2 * L)] if b < L else [])
    assert units == expected and calls[mixed].units == (2 * a, 2 * b)
    assert [len(c.tokens) for c in calls] == [2 if c is not calls[mixed] else 102 for c in calls]
    pre_src = calls[mixed].src[2:]
    assert (pre_src == -1).all() if a == 0 else (pre_src == 4 + np.arange(100)).all()
    pre_dst = calls[mixed].dst[2:]
    assert (pre_dst == -1).all() if b == L else (pre_dst == 4 + np.arange(100)).all()
    samplers = [c for c in calls if c.sample_rows]
    assert len(samplers) == 1 and samplers[0] is calls[-1]
