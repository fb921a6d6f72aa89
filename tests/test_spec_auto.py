"""`"num_speculative_tokens": "auto"`: the roofline of a verification step on a MoE
(lp_jax/roofline/spec_pays.py), the k it picks (lp_jax/spec/auto.py) with the acceptance it
measures, and an engine that runs it: the fake executor's (nothing compiles) and the shared
tiny engine's programs, greedy tokens unchanged."""

import json
import math

import numpy as np
import pytest
from test_engine_fake import VOCAB, fake_llm
from test_spec_engine import _prompts

from lp_jax import LLM, SamplingParams
from lp_jax.core.scheduler import Scheduler
from lp_jax.roofline.hardware import get_hardware
from lp_jax.roofline.model_shape import resolve_model
from lp_jax.roofline.spec_pays import (
    SpecSetup,
    break_even_alpha,
    hardware_for_device,
    max_batch,
)
from lp_jax.spec.auto import AutoK, expected_tokens
from lp_jax.spec.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig

QWEN3_MOE = resolve_model("Qwen3-30B-A3B")  # E = 128, top-8, bf16
QWEN3_DENSE = resolve_model("Qwen3-8B")
H200, V6E = get_hardware("h200"), get_hardware("v6e")  # ridge 206 and 560 FLOP / byte
AUTO = {"method": "ngram", "num_speculative_tokens": "auto", "prompt_lookup_max": 2}


def test_tokens_per_step_and_break_even():
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert (expected_tokens(1.0, 3), expected_tokens(0.0, 5)) == (4.0, 1.0)
    assert break_even_alpha(1.5, 1) == pytest.approx(0.5)
    assert break_even_alpha(1.75, 2) == pytest.approx(0.5)
    assert break_even_alpha(2.5, 1) == math.inf  # even a perfect draft cannot pay
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens(1.2, 1)


def test_verified_rows_load_experts_of_their_own():
    """One sequence on one H200: its draft row routes to 8 experts the first row mostly
    did not pick, so a step verifying one draft costs > 1.4 decode steps on the MoE and
    next to nothing on a dense model of the same attention; at B = 64 the batch has
    loaded most experts already and a draft row is nearly free on the MoE too."""
    moe, dense = SpecSetup(QWEN3_MOE, H200), SpecSetup(QWEN3_DENSE, H200)
    assert moe.step_ratio(1, 1) > 1.4
    assert dense.step_ratio(1, 1) < 1.01
    assert moe.step_ratio(64, 1) < 1.05
    # draft cost on top of verification: none for n-gram, positive for EAGLE-3 and MTP
    eagle = SpecSetup(QWEN3_MOE, H200, draft="eagle3")
    mtp = SpecSetup(QWEN3_MOE, H200, draft="mtp")
    assert moe.draft_seconds(16, 3) == 0.0
    assert 0 < eagle.draft_seconds(16, 3) < mtp.draft_seconds(16, 3)


def test_the_simulator_costs_verification_rows_as_the_roofline_does():
    """The cost-model executor runs a plan's k + 1 verification rows per decode (their
    experts, attention and logits): its step with drafts over its step without is the
    analytic ratio (uniform routing, the default calibration has no overheads)."""
    from lp_jax.core.plan import StepPlan
    from lp_jax.core.sequence import Sequence
    from lp_jax.roofline.routing import UNIFORM
    from lp_jax.sim.executor import CostModelExecutor

    setup = SpecSetup(QWEN3_MOE, H200, context=64)
    ex = CostModelExecutor(QWEN3_MOE, H200, routing=UNIFORM)
    seqs = tuple(Sequence(i, [1] * 64, _greedy(8)) for i in range(4))
    L = QWEN3_MOE.num_layers
    plain = ex.run(StepPlan(step_id=0, num_layers=L, decode=seqs)).seconds
    spec = ex.run(StepPlan(step_id=1, num_layers=L, decode=seqs, drafts=((7, 7, 7),) * 4))
    assert spec.seconds / plain == pytest.approx(setup.step_ratio(4, 3), rel=1e-3)
    assert spec.seconds / plain > 2


def test_auto_turns_speculation_off_on_a_large_batch_on_a_compute_bound_chip():
    """Qwen3-30B-A3B (bf16) on one H200 at 128 tokens of context and B = 4096 sequences
    (whose KV fits beside the weights): 4096 (k + 1) rows make the expert GEMMs
    compute-bound, so at the prior acceptance (0.6) every k costs more than it emits:
    k = 0. The same load on a v6e (ridge 560, memory-bound there) and 64 sequences on the
    H200 pay: k > 0."""
    setup = SpecSetup(QWEN3_MOE, H200, context=128)
    assert max_batch(setup) >= 4096
    auto = AutoK(setup.step_ratio, MAX_SPECULATIVE_TOKENS)
    assert auto.alpha == pytest.approx(0.6)
    assert auto.choose(4096) == 0
    assert all(setup.speedup(0.6, 4096, k) < 1 for k in range(1, 9))
    assert auto.choose(64) > 0
    assert AutoK(SpecSetup(QWEN3_MOE, V6E, context=128).step_ratio, 8).choose(4096) > 0


def test_auto_turns_speculation_off_for_two_sequences_on_a_moe_not_on_a_dense_model():
    """At acceptance 0.5 and B = 2 on the H200, the MoE's draft rows load experts of their
    own and no k pays (k = 0), while the dense model speculates (k > 0)."""
    moe = AutoK(SpecSetup(QWEN3_MOE, H200).step_ratio, 8, prior_alpha=0.5)
    dense = AutoK(SpecSetup(QWEN3_DENSE, H200).step_ratio, 8, prior_alpha=0.5)
    assert (moe.choose(2), dense.choose(2) > 0) == (0, True)
    assert dense.choose(2, max_rows=6) == 2  # 2 (k + 1) verification rows fit in 6
    assert dense.choose(8, max_rows=8) == 0


def _geometric_run(rng, alpha: float, drafts: int) -> int:
    """Accepted drafts of one run: each stands with probability alpha after those before."""
    n = 0
    while n < drafts and rng.random() < alpha:
        n += 1
    return n


def test_acceptance_estimate_follows_the_workload():
    """The Beta estimate counts only the draft positions tested (a run stops at its first
    rejection), so it finds a per-token alpha of 0.8 where accepted / drafted (~0.6 with 4
    drafts) would not; with k then > 0 where a k pays at 0.8, and 0 once the acceptance
    falls to 0.2 and the old trials have decayed."""
    rng = np.random.default_rng(0)
    auto = AutoK(lambda B, k: 1.0 + 0.25 * k, 8, window=512)
    accepted = drafted = 0
    for _ in range(300):
        a = _geometric_run(rng, 0.8, 4)
        auto.observe(4, a)
        accepted, drafted = accepted + a, drafted + 4
    assert auto.alpha == pytest.approx(0.8, abs=0.04)
    assert accepted / drafted < 0.7
    assert auto.choose(8) > 0
    for _ in range(3000):
        auto.observe(4, _geometric_run(rng, 0.2, 4))
    assert auto.alpha == pytest.approx(0.2, abs=0.05)
    assert auto.choose(8) == 0
    with pytest.raises(ValueError, match="accepted 3 of 2"):
        auto.observe(2, 3)


def test_config_auto_and_its_errors():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": "auto"}')
    assert (c.is_auto, c.max_tokens) == (True, MAX_SPECULATIVE_TOKENS)
    assert not SpeculativeConfig(num_speculative_tokens=3).is_auto
    for bad in ("Auto", "3", None):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            SpeculativeConfig(num_speculative_tokens=bad)
    from conftest import make_sched_cfg

    with pytest.raises(ValueError, match="cost model"):
        Scheduler(make_sched_cfg("layered", speculative_config=c))
    from lp_jax import serve

    args = serve.build_parser().parse_args(["--speculative-config", json.dumps(AUTO)])
    assert serve.engine_config(args).speculative_config.is_auto
    assert hardware_for_device("NVIDIA H200")[0] is H200
    assert hardware_for_device("TPU v6 lite") == (V6E, True)
    assert hardware_for_device("cpu")[1] is False


def _greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_fake_engine_auto_speculates_and_off_means_off():
    """On the fake executor: "auto" drafts (k > 0 at these batches) and leaves the greedy
    outputs as they are; a chooser under which nothing pays drafts nothing, and with
    overlapped scheduling holds no sequence back: as many steps as without speculation."""
    params = [_greedy(20), _greedy(17), _greedy(9)]
    base = fake_llm("layered", max_num_seqs=16)
    want = [o.outputs[0].token_ids for o in base.generate(prompt_token_ids=_prompts(),
                                                          sampling_params=params)]
    auto = fake_llm("layered", max_num_seqs=16, speculative_config=AUTO)
    got = auto.generate(prompt_token_ids=_prompts(), sampling_params=params)
    assert [o.outputs[0].token_ids for o in got] == want
    s = auto.stats()
    assert s["spec_decode_num_accepted_tokens"] > 0
    assert s["free_pages"] == s["total_pages"]

    off = fake_llm("layered", max_num_seqs=16, speculative_config=AUTO)
    off.engine.scheduler.spec_auto = AutoK(lambda B, k: k + 2.0, 8)  # nothing ever pays
    got = off.generate(prompt_token_ids=_prompts(), sampling_params=params)
    assert [o.outputs[0].token_ids for o in got] == want
    s_off = off.stats()
    assert s_off["spec_decode_num_drafts"] == 0
    assert s_off["iterations"] == base.stats()["iterations"]


def test_auto_on_the_tiny_engine_equals_plain_greedy_without_compiles(engines):
    """The shared tiny engine's checkpoint with "auto": greedy tokens equal the shared
    engine's, drafts verified (the k + 1 rows land in row buckets compiled at start-up),
    the same programs, no compile while serving, every page back."""
    pat = np.random.default_rng(0).integers(0, VOCAB, 12).tolist()  # outputs repeat
    prompts = [pat * 4, pat[:5] * 6]
    params = [_greedy(32), _greedy(8)]  # then one sequence alone: k <= 3 in 4 rows
    base = engines("layered").generate(prompt_token_ids=prompts, sampling_params=params)
    llm = LLM(**engines.kwargs("layered"), speculative_config=AUTO)  # programs from the cache
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in base]
    s = llm.stats()
    assert s["spec_decode_num_accepted_tokens"] > 0
    assert s["compilations_after_warmup"] == 0
    assert s["programs"] == engines("layered").stats()["programs"]
    assert s["free_pages"] == s["total_pages"]
