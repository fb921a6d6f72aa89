"""Data-parallel attention beside expert parallelism for the model families beyond Qwen3-MoE,
on the host's 8 simulated CPUs, checked by behaviour only (tokens, pages, stats, compiles):

* GPT-OSS (sliding window, sinks) on DP 2 x TP 4 and DeepSeek-V3 (MLA, its latent pool
  split over the ranks) on DP 4 x TP 2, each under layered and chunked, give Hugging Face's greedy
  tokens (tests/golden, which the single-device engines match: test_gpt_oss,
  test_deepseek_v3), with the golden runs' engine shapes (conftest GOLDEN_ENGINES) and
  staggered prompts (run_golden_prompts);
* after every step, each sequence's pages lie in one rank's page-id range and the ranks'
  used pages add up to the pool's;
* uneven load: prefix affinity fills one rank to its sequence limit while the other
  idles; the idle rank's rows are counted as padding, the tokens stay Hugging Face's;
* nothing compiles while serving, one program each, every page free at the end.

Four engines, one compile each: the prompts are the golden files' and only the first
NEW_TOKENS greedy tokens are compared (enough for prefills beside decodes on every rank).
"""

import numpy as np
import pytest
from conftest import GOLDEN_ENGINES, run_golden_prompts

from checkpoints.make_tiny import ensure_tiny
from lp_jax import LLM, SamplingParams

GOLDEN = "tests/golden/{}.npz"
NEW_TOKENS = 8
MAX_PROGRAMS = 32  # the start-up budget at defaults (tests/test_programs.py)
PAGES_PER_RANK = 10  # two 80-token sequences of 16-token pages
# (preset, data ranks, tensor ranks, policy): every layout spans all 8 devices, EP = 8.
LAYOUTS = {"gpt-oss": ("tiny-gpt-oss", 2, 4, "layered"),
           "gpt-oss-chunked": ("tiny-gpt-oss", 2, 4, "chunked"),
           "deepseek": ("tiny-deepseek", 4, 2, "chunked"),
           "deepseek-layered": ("tiny-deepseek", 4, 2, "layered")}


def lazy_dp_engines(layouts: dict, shapes: dict, env: dict | None = None, **kw):
    """(get, built): get(name) is the engine of layouts[name] = (preset, dp, tp, policy),
    built on first use with shapes[policy] (max_model_len 80, PAGES_PER_RANK pages a
    rank) and `env` set while it builds (read while the programs trace); `built` holds
    them for the fixture to shut down."""
    built = {}

    def get(name: str) -> LLM:
        if name not in built:
            preset, dp, tp, policy = layouts[name]
            with pytest.MonkeyPatch.context() as mp:
                for key, value in (env or {}).items():
                    mp.setenv(key, value)
                built[name] = LLM(str(ensure_tiny(preset=preset)), data_parallel_size=dp,
                                  tensor_parallel_size=tp, enable_expert_parallel=True,
                                  max_num_seqs=4, max_model_len=80,
                                  kv_pages=PAGES_PER_RANK * dp, backends="off", log=None,
                                  **kw, **shapes[policy])
        return built[name]

    return get, built


@pytest.fixture(scope="module")
def dp_engine():
    """dp_engine(name): the module's engine of LAYOUTS[name], built on first use, with the
    golden engines' shapes (max_model_len 80, one row bucket)."""
    get, built = lazy_dp_engines(LAYOUTS, GOLDEN_ENGINES)
    yield get
    for llm in built.values():
        llm.shutdown()


class RankChecked:
    """An engine whose every step is followed by the check that pages stay on their rank."""

    def __init__(self, engine):
        self.engine = engine

    def add_request(self, *args, **kwargs):
        return self.engine.add_request(*args, **kwargs)

    def step(self):
        outs = self.engine.step()
        assert_pages_stay_on_their_rank(self.engine)
        return outs


def assert_pages_stay_on_their_rank(engine):
    """Rank r owns the page ids [r P_r, (r + 1) P_r) (docs/data_parallel.md): a live
    sequence's pages all fall in one such range, and the per-rank counts add up."""
    stats = engine.stats()
    bal = stats["data_parallel"]
    ranks = len(bal["free_pages"])
    per_rank = stats["total_pages"] // ranks
    sched = engine.scheduler
    for seq in sched.running + sched.prefilling:
        assert len({p // per_rank for p in seq.page_ids}) <= 1, (seq.seq_id, seq.page_ids)
    assert sum(bal["free_pages"]) == stats["free_pages"]
    assert [u + f for u, f in zip(bal["used_pages"], bal["free_pages"], strict=True)] == [
        per_rank] * ranks


def assert_clean(llm, ranks):
    stats = llm.stats()
    assert stats["data_parallel"]["free_pages"] == [PAGES_PER_RANK] * ranks
    assert stats["free_pages"] == stats["total_pages"] == PAGES_PER_RANK * ranks
    assert stats["compilations_after_warmup"] == 0
    assert stats["programs"] == 1 and stats["startup_compilations"] <= MAX_PROGRAMS


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dp_attention_gives_the_golden_tokens(dp_engine, name):
    """Prompts of 5, 17 and 40 tokens, the later two arriving while the first decodes: the
    placement spreads them over the ranks, every rank runs rows, tokens equal the golden."""
    preset, dp, tp, policy = LAYOUTS[name]
    golden = np.load(GOLDEN.format(preset))
    llm = dp_engine(name)
    kv = llm.engine.runner.kv_pages  # each rank's devices hold only its own pages
    assert kv.sharding.shard_shape(kv.shape)[0] == kv.shape[0] // dp
    outs = run_golden_prompts(RankChecked(llm.engine), golden, max_tokens=NEW_TOKENS)
    for i in range(3):
        assert outs[i].token_ids == golden[f"greedy_{i}"][:NEW_TOKENS].tolist(), f"prompt {i}"
    bal = llm.stats()["data_parallel"]
    busy = sum(r > 0 for r in bal["rows"])
    assert busy == min(dp, 3)  # three prompts: at most one rank idles (DP 4)
    if busy < dp:
        assert bal["padded_rows"] > 0
    assert_clean(llm, dp)


def test_one_rank_full_by_prefix_affinity_while_the_other_idles(dp_engine):
    """DP 2 (two sequences a rank): a prompt run once leaves its pages cached on its rank;
    two copies of it then both go to that rank (each hits the cached pages) and fill its
    sequence slots, the other rank idles. Every row the full rank runs is matched by a
    padded row of the idle one; the tokens are still Hugging Face's."""
    preset, dp, _, _ = LAYOUTS["gpt-oss"]
    golden = np.load(GOLDEN.format(preset))
    llm = dp_engine("gpt-oss")
    eng = llm.engine
    prompt = golden["prompt_2"].tolist()  # 40 tokens: two full pages to share
    want = golden["greedy_2"][:NEW_TOKENS].tolist()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first = llm.stats()["data_parallel"]["rows"]
    assert [o.token_ids for o in llm.generate(prompt_token_ids=[prompt],
                                               sampling_params=params)] == [want]
    before = llm.stats()["data_parallel"]
    cached_on = [r for r in range(dp) if before["rows"][r] > first[r]]
    hits = eng.scheduler.stats()["prefix_cache_hits"]
    ids = [eng.add_request(prompt, params) for _ in range(2)]
    outs, full = {}, None
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
        assert_pages_stay_on_their_rank(eng)
        if full is None:
            full = eng.stats()["data_parallel"]["seqs"]
    assert [outs[i] for i in ids] == [want, want]
    after = llm.stats()["data_parallel"]
    ran = [a - b for a, b in zip(after["rows"], before["rows"], strict=True)]
    busy = [r for r in range(dp) if ran[r]]
    assert len(busy) == 1 and full[busy[0]] == 2  # one rank at its limit, the other idle
    assert busy[0] in cached_on  # ...the rank that ran the prompt first
    assert after["padded_rows"] - before["padded_rows"] == max(ran)
    assert eng.scheduler.stats()["prefix_cache_hits"] - hits == 2 * 32  # two pages each
    assert_clean(llm, dp)


def test_a_long_prompt_leaves_the_other_ranks_budget(dp_engine):
    """Chunked, a budget of 32 tokens a rank (core/budget.py): the 40-token and 17-token
    prompts arrive together; the first plan prefills 32 tokens of the long one on its
    rank and the whole short one on the other (one budget for both ranks would have
    left it waiting), and the tokens are still Hugging Face's."""
    preset, dp, _, _ = LAYOUTS["gpt-oss-chunked"]
    golden = np.load(GOLDEN.format(preset))
    llm = dp_engine("gpt-oss-chunked")
    eng = llm.engine
    assert eng.reset_prefix_cache()  # earlier tests cached these prompts
    plans, schedule, bm = [], eng.scheduler.schedule, eng.scheduler.block_manager

    def recording(now):  # each plan's chunks: (prompt length, start, end, rank)
        plan = schedule(now)
        plans.append([(c.seq.num_prompt_tokens, c.start, c.end, bm.rank_of(c.seq))
                      for c in plan.prefill])
        return plan

    eng.scheduler.schedule = recording
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    try:
        ids = {eng.add_request(golden[f"prompt_{i}"].tolist(), params): i for i in (2, 1)}
        outs = {}
        while eng.has_unfinished():
            outs.update({ids[o.request_id]: o.token_ids for o in eng.step() if o.finished})
            assert_pages_stay_on_their_rank(eng)
    finally:
        eng.scheduler.schedule = schedule
    assert plans[0] == [(40, 0, 32, 0), (17, 0, 17, 1)]
    for i in (1, 2):
        assert outs[i] == golden[f"greedy_{i}"][:NEW_TOKENS].tolist(), f"prompt {i}"
    assert_clean(llm, dp)
