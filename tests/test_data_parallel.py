"""Data-parallel attention beside expert parallelism on the host's 8 simulated CPUs: the
rank-aware page pools (placement, prefix affinity, per-rank limits, no page leaks), the
flags, and engines on DP 2 and DP 4 with the experts over every chip giving the
single-device model's tokens under chunked and layered, with no compile while serving
and within the program budget."""

import re

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from checkpoints.make_tiny import ensure_tiny
from lp_jax import LLM, SamplingParams
from lp_jax.aot import load_config
from lp_jax.core.dp_placement import RankedBlockManager
from lp_jax.core.plan import PrefillChunk, StepPlan
from lp_jax.core.programs import hidden_rows
from lp_jax.engine.config import EngineConfig
from lp_jax.loader import load_model
from lp_jax.models.backends import KernelBackends
from lp_jax.models.kv_cache import layer_pages, layer_slots
from lp_jax.models.simple import greedy_generate
from lp_jax.sharding import make_mesh, parallel_mesh_shape, partition_spec
from pallas_kernels import compile_targets
from tests.conftest import make_sched_cfg, make_seq

PROMPTS = [[5, 17, 99, 3, 250, 42, 7, 311, 64, 128, 9], list(range(1, 21)),
           [7, 7, 1, 2, 3], [300, 200, 100, 50, 25, 12, 6, 3]]
NEW_TOKENS = 6
MAX_PROGRAMS = 32  # the start-up budget at defaults (tests/test_programs.py)
S = 4  # page size of the pool tests


def _pool(pages=16, ranks=2, seqs=2, caching=False):
    return RankedBlockManager(pages, S, ranks, max_seqs_per_rank=seqs, enable_caching=caching)


def test_each_rank_owns_a_range_of_page_ids_and_load_is_balanced():
    bm = _pool()
    a, b, c = (make_seq(i, list(range(10 * i, 10 * i + n))) for i, n in ((0, 9), (1, 5), (2, 3)))
    bm.allocate(a, 9)  # 3 pages on rank 0 (ties go to the lower rank)
    bm.allocate(b, 5)  # rank 1: fewer pages in use
    bm.allocate(c, 3)  # rank 1 again: 2 + 1 pages there against rank 0's 3
    assert [bm.rank_of(s) for s in (a, b, c)] == [0, 1, 1]
    assert all(p < 8 for p in a.page_ids) and all(8 <= p < 16 for p in b.page_ids + c.page_ids)
    assert bm.balance()["seqs"] == [1, 2] and bm.balance()["used_pages"] == [3, 3]
    d = make_seq(3, [1, 2, 3])
    assert bm.place(d, 3) == 0  # rank 1 is at its sequence limit
    bm.append_slot(c)  # decode pages come from the sequence's own rank
    c.token_ids += [9] * 4
    bm.append_slot(c)
    assert all(8 <= p < 16 for p in c.page_ids)
    for s in (a, b, c):
        bm.free(s)
    assert bm.num_free_pages == 16 and bm.balance()["seqs"] == [0, 0]
    with pytest.raises(RuntimeError, match="holds no pages"):
        bm.free(a)


def test_a_full_rank_sends_new_sequences_to_the_other_and_nothing_leaks():
    """Uneven load: one rank's pool full, the other takes every new sequence; a sequence
    larger than any one rank's share is never placed."""
    bm = _pool(pages=8, seqs=4)
    big = make_seq(0, list(range(16)))
    bm.allocate(big, 16)  # all 4 pages of rank 0
    assert bm.balance()["free_pages"] == [0, 4]
    smalls = [make_seq(i, [i] * 3) for i in range(1, 5)]
    for s in smalls:
        assert bm.can_allocate(s, 3)
        bm.allocate(s, 3)
        assert bm.rank_of(s) == 1
    assert not bm.can_allocate(make_seq(9, [1]), 1)
    with pytest.raises(RuntimeError, match="no data-parallel rank"):
        bm.allocate(make_seq(9, [1]), 1)
    assert not bm.can_allocate(make_seq(10, list(range(20))), 20)  # 5 pages > a rank's 4
    for s in [big, *smalls]:
        bm.free(s)
    assert bm.balance()["free_pages"] == [4, 4]


def test_prefix_hits_pull_a_sequence_to_the_rank_that_cached_them():
    bm = _pool(caching=True, seqs=4)
    prompt = list(range(100, 113))  # 3 full pages and one token
    first = make_seq(0, list(prompt))
    bm.allocate(first, 13)
    bm.publish(first, 13)
    bm.allocate(make_seq(1, [1] * 4), 4)  # rank 1 now has fewer pages in use...
    bm.allocate(make_seq(2, [2] * 4), 4)
    again = make_seq(3, list(prompt))
    assert bm.place(again, 13) == bm.rank_of(first) == 0  # ...but rank 0 holds the prefix
    assert bm.allocate(again, 13) == 12 and again.page_ids[:3] == first.page_ids[:3]
    assert not bm.reset_prefix_cache()  # pages still held


def test_prefix_affinity_gives_way_to_load():
    """Each hit page counts as a page saved: copies of one prompt gather on the rank that
    cached it until that rank's load outweighs the hit, then go to the idle rank."""
    bm = _pool(caching=True, seqs=4)
    prompt = list(range(100, 113))  # 4 pages, 3 of them hit-able
    filler = make_seq(0, list(range(16)))
    bm.allocate(filler, 16)  # rank 0: 4 pages
    first = make_seq(1, list(prompt))
    bm.allocate(first, 13)  # rank 1
    bm.publish(first, 13)
    bm.free(filler)  # rank 0 idle
    copies = [make_seq(i, list(prompt)) for i in range(2, 5)]
    for s in copies:
        bm.allocate(s, 13)
    # Rank 1 at 4 then 5 pages: 1 fresh page less 3 hit beats rank 0's 4 fresh ones; at
    # 6 pages they tie and the rank with fewer sequences takes the third copy, unhit.
    assert [bm.rank_of(s) for s in copies] == [1, 1, 0]
    assert [len(set(s.page_ids) & set(first.page_ids)) for s in copies] == [3, 3, 0]


def test_padding_of_the_spmd_step_is_counted():
    bm = _pool(seqs=4)
    a, b = make_seq(0, list(range(9))), make_seq(1, [1, 2])
    bm.allocate(a, 9)
    bm.allocate(b, 2)
    plan = StepPlan(step_id=0, num_layers=2, prefill_batch_id=0,
                    prefill=(PrefillChunk(a, 0, 9), PrefillChunk(b, 0, 2)))
    bm.count_rows(plan)
    bal = bm.balance()
    assert bal["rows"] == [9, 2] and bal["padded_rows"] == 7  # rank 1 runs 9 rows: 7 pad


def test_a_rank_major_pool_keeps_each_ranks_pages_of_every_layer_together():
    cfg = load_config("qwen3-30b-a3b").replace(num_hidden_layers=3)
    pages = np.arange(8)  # P = 8 logical pages, pool of L P = 24 rows
    rows = np.stack([np.asarray(layer_pages(cfg, i, pages, 24)) for i in range(3)])
    assert (rows == pages + 8 * np.arange(3)[:, None]).all()  # one rank: layer-major
    rows = np.stack([np.asarray(layer_pages(cfg.replace(kv_ranks=2), i, pages, 24))
                     for i in range(3)])
    assert sorted(rows[:, :4].ravel()) == list(range(12))  # rank 0: rows [0, 12)
    assert sorted(rows[:, 4:].ravel()) == list(range(12, 24))  # rank 1: rows [12, 24)
    slots = np.array([-1, 0, 5, 4 * 4 + 3])  # page size 4
    got = np.asarray(layer_slots(cfg.replace(kv_ranks=2), 1, slots, 24, 4))
    assert list(got) == [-1, 4 * 4, 5 * 4 + 1, (12 + 4) * 4 + 3]


def test_flags_map_data_parallel_attention_onto_the_mesh():
    assert parallel_mesh_shape(data_parallel_size=2, tensor_parallel_size=4,
                               enable_expert_parallel=True) == {"data": 2, "expert": 1,
                                                                "tensor": 4}
    with pytest.raises(ValueError, match="independent replicas"):
        parallel_mesh_shape(data_parallel_size=2)
    with pytest.raises(ValueError, match="this model has none"):
        parallel_mesh_shape(data_parallel_size=2, enable_expert_parallel=True,
                            has_experts=False)
    with pytest.raises(ValueError, match="independent replicas"):
        EngineConfig(data_parallel_size=4)
    EngineConfig(data_parallel_size=4, enable_expert_parallel=True)
    EngineConfig(data_parallel_size=2, enable_expert_parallel=True, attention_backend="tpu")
    for draft in ({"method": "eagle3", "model": "/head"}, {"method": "mtp"}):  # per rank
        EngineConfig(data_parallel_size=2, enable_expert_parallel=True,
                     speculative_config=draft | {"num_speculative_tokens": 2})
    # The experts spread over every chip, attention's heads over "tensor" only.
    mesh = make_mesh(2, 1, 4)
    assert partition_spec(("layers", "experts", "embed", "expert_mlp"), (2, 8, 4, 4),
                          mesh) == P(None, ("data", "tensor"), None, None)
    assert partition_spec(("embed", "q_heads"), (4, 8), mesh) == P(None, "tensor")
    from lp_jax.serve import build_parser, engine_config

    cfg = engine_config(build_parser().parse_args(
        ["--data-parallel-size", "2", "--enable-expert-parallel"]))
    assert (cfg.data_parallel_size, cfg.enable_expert_parallel) == (2, True)


@pytest.fixture(scope="module")
def reference():
    """Greedy tokens of the single-device tiny Qwen3-MoE (xla kernels)."""
    model = load_model(ensure_tiny(preset="tiny"))
    rows = max(map(len, PROMPTS))
    return [greedy_generate(model, p, NEW_TOKENS, backends=KernelBackends(
        moe="xla", attention="xla"), prefill_rows=rows,
        num_pages=-(-(rows + NEW_TOKENS) // 16)) for p in PROMPTS]


@pytest.fixture(scope="module")
def dp_engines():
    """dp_engines(dp, tp, scheduling): the module's engine of that layout, built on first
    use. One row bucket, so one program serves every step; backends "off": the xla
    kernels need no start-up self-test. Layered runs two layer groups, so a batch's rows
    are carried between plans in the hidden buffer (d budgets of rows under DP). The
    layered engines dispatch the experts by XLA's allreduce scheme ("auto" on these
    shapes), the chunked ones by all_to_all (each device's share of its rank's rows
    travels to the experts' owners)."""
    built = {}

    def get(dp: int, tp: int, scheduling: str) -> LLM:
        if (dp, tp, scheduling) not in built:
            built[dp, tp, scheduling] = LLM(
                str(ensure_tiny(preset="tiny")), data_parallel_size=dp,
                tensor_parallel_size=tp, enable_expert_parallel=True, scheduling=scheduling,
                max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32,
                token_buckets=(36,), kv_pages=8 * dp, backends="off", log=None,
                moe_dispatch="all_to_all" if scheduling == "chunked" else "auto",
                **({"layer_groups": 2} if scheduling == "layered" else {}))
        return built[dp, tp, scheduling]

    return get


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


# One compile per row: each layout once, each policy once (a policy's carried-hidden
# buffer is part of its program, so chunked and layered share no program).
@pytest.mark.parametrize("dp,tp,scheduling", [(2, 4, "layered"), (4, 2, "chunked")])
def test_dp_attention_gives_the_single_device_tokens(reference, dp_engines, dp, tp,
                                                     scheduling):
    """DP ranks with the experts over all dp x tp devices: the sequences spread over the
    ranks' pools, tokens equal the single-device model's, every page returns. The 44
    prompt tokens pass one rank's budget of 32, but each rank's share fits its own
    (core/budget.py), so one prefill batch takes them all (under layered, carried
    between its two groups in hidden rows past one budget's)."""
    llm = dp_engines(dp, tp, scheduling)
    batches = llm.engine.scheduler.stats()["prefill_batches"]
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert llm.engine.scheduler.stats()["prefill_batches"] - batches == 1
    experts = llm.engine.runner.state["model"]["layers"]["mlp"]["experts_gate_up_proj"][...]
    assert len(experts.sharding.device_set) == dp * tp
    kv = llm.engine.runner.kv_pages  # each rank's devices hold only its own pages
    assert kv.sharding.spec[0] == "data"
    assert kv.sharding.shard_shape(kv.shape)[0] == kv.shape[0] // dp
    # ...and only its own block of the carried-hidden buffer: one rank's budget of rows
    hidden = llm.engine.runner.hidden_RD
    assert hidden.sharding.shard_shape(hidden.shape)[0] == hidden_rows(
        llm.engine.scheduler.config) == 4 + (32 if scheduling == "layered" else 0)
    stats = llm.stats()
    bal = stats["data_parallel"]
    assert min(bal["rows"]) > 0 and bal["free_pages"] == [8] * dp  # every rank ran rows
    assert stats["free_pages"] == stats["total_pages"] == 8 * dp
    assert stats["compilations_after_warmup"] == 0
    assert stats["programs"] == 1 and stats["startup_compilations"] <= MAX_PROGRAMS


def rows_across_ranks(reduces: list[tuple[str, bool]], max_num_seqs: int) -> list[str]:
    """The all-reduces spanning data ranks that carry more rows than the sampled ones
    (max_num_seqs rows reach lm_head by one all-reduce over data when the hidden buffer
    is split; scalars too): rows that should stay on their rank."""
    return [shape for shape, spans in reduces
            if spans and int(re.match(r"\w+\[(\d*)", shape)[1] or 0) > max_num_seqs]


def _all_reduces(hlo: str, data: int, tensor: int) -> list[tuple[str, bool]]:
    """(result shape, whether a group spans data ranks) of each all-reduce in a compiled
    program on a (data, 1, tensor) mesh (device k on rank k // tensor). Groups come in
    three spellings: mesh axes (`mesh['data'=2,...] {'data'}`; 'axis_0' is data where
    the unit axis is dropped), iota (`[2,4]<=[8]`, `[4,2]<=[2,4]T(1,0)`) or explicit."""
    out = []
    for m in re.finditer(r"= (\S+) all-reduce(?:-start)?\((.*)", hlo):
        shape, rest = m.group(1), m.group(2)
        named = re.search(r"replica_groups=mesh\[[^]]*\] \{([^}]*)\}", rest)
        iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?",
                         rest)
        explicit = re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", rest)
        if named:
            spans = bool(set(re.findall(r"'(\w+)'", named.group(1))) & {"data", "axis_0"})
        else:
            if iota:
                dims = [int(d) for d in iota.group(3).split(",")]
                ids = np.arange(int(np.prod(dims))).reshape(dims)
                if iota.group(4):
                    ids = ids.transpose([int(p) for p in iota.group(4).split(",")])
                groups = ids.reshape(int(iota.group(1)), int(iota.group(2))).tolist()
            else:
                assert explicit, rest[:200]
                groups = [[int(i) for i in g.split(",")]
                          for g in re.findall(r"\{([\d,]+)\}", explicit.group(1))]
            spans = any(len({k // tensor for k in g}) > 1 for g in groups)
        out.append((shape, spans))
    return out


@pytest.mark.parametrize("dp,tp,scheduling", [(2, 4, "layered"), (4, 2, "chunked")])
def test_each_rank_attends_its_own_rows_and_pool_shard(dp_engines, dp, tp, scheduling):
    """The program runs N rows on each rank (dp N in all) and its attention reads each
    rank's pool shard with the rank's own rows, so no all-reduce of rows spans the data
    axis (rows replicated over the ranks needed one of the pages every layer, and GSPMD's
    MoE one of its sorted rows). What does span it: the sampled rows for lm_head (at most
    max_num_seqs = 4, each from its rank's rows, zeros elsewhere; the rows themselves stay
    split, carried in each rank's block of the hidden buffer) and scalars."""
    llm = dp_engines(dp, tp, scheduling)
    (N, program), = llm.engine.runner.programs.items()
    hlo = program.as_text()
    assert re.search(rf"s32\[{dp * N}\]\{{0\}} parameter", hlo)  # the dp N rows' tokens
    reduces = _all_reduces(hlo, data=dp, tensor=tp)
    assert reduces and not rows_across_ranks(reduces, max_num_seqs=4)


def test_one_rank_idle(reference, dp_engines):
    """Uneven load on DP 2: a lone request runs on one rank while the other idles; the
    idle rank's rows are counted as padding, and every page returns."""
    llm = dp_engines(2, 4, "layered")
    before = llm.stats()["data_parallel"]
    out = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=GREEDY)
    assert [o.token_ids for o in out] == reference[:1]
    after = llm.stats()["data_parallel"]
    ran = [a - b for a, b in zip(after["rows"], before["rows"], strict=True)]
    # the prompt in each of its two layer groups' plans, then the decodes
    assert sorted(ran) == [0, 2 * len(PROMPTS[0]) + NEW_TOKENS - 1]
    assert after["padded_rows"] - before["padded_rows"] == max(ran)
    assert after["free_pages"] == [8, 8] and llm.stats()["compilations_after_warmup"] == 0


def test_the_scheduler_refuses_a_request_larger_than_a_ranks_pool():
    from lp_jax.core.scheduler import Scheduler

    sched = Scheduler(make_sched_cfg("chunked", num_pages=8, data_parallel_size=2))
    with pytest.raises(ValueError, match="a data-parallel rank's pool has only 4"):
        sched.add(make_seq(0, 17, max_tokens=1))  # 17 tokens of KV: 5 pages of 4
    sched.add(make_seq(1, 16, max_tokens=1))  # 4 pages: fits one rank
    with pytest.raises(ValueError, match="split evenly"):
        make_sched_cfg("chunked", num_pages=9, data_parallel_size=2)


def test_the_roofline_gives_dp_attention_the_kv_room_tp_cannot():
    """DeepSeek-V3 FP8 on 64 v6e chips: TP attention keeps every token's latent on every
    chip; DP 16 x TP 4 keeps each token on one rank only, so the slice holds 16 times one
    chip's room; DP 64 (t = 1) copies attention on every chip and does not fit."""
    from lp_jax.roofline.dp_attention import (
        dp_chip_layout,
        dp_link_bytes_per_layer,
        padded_rows,
        slice_kv_tokens,
    )
    from lp_jax.roofline.hardware import get_hardware
    from lp_jax.roofline.layout import chip_layout
    from lp_jax.roofline.model_shape import DEEPSEEK_V3

    hw, shape = get_hardware("TPU v6e"), DEEPSEEK_V3.with_formats("fp8_block", None)
    tp, dp = chip_layout(shape, (1, 1, 64)), dp_chip_layout(shape, 16, 4)
    assert dp.kv_bytes_per_token == tp.kv_bytes_per_token  # the latent, whole, either way
    experts = shape.num_moe_layers * shape.expert_bytes_per_layer
    assert dp.weight_bytes - chip_layout(shape, (1, 1, 4)).weight_bytes == pytest.approx(
        experts / 64 - experts / 4)
    assert slice_kv_tokens(shape, (16, 1, 4), hw.hbm_bytes) == 16 * dp.kv_tokens(hw.hbm_bytes)
    # 8.2x: FP8 routed experts, the dense projections in bf16 (as an FP8 checkpoint loads)
    assert slice_kv_tokens(shape, (16, 1, 4), hw.hbm_bytes) > 8 * slice_kv_tokens(
        shape, (1, 1, 64), hw.hbm_bytes)
    assert slice_kv_tokens(shape, (64, 1, 1), hw.hbm_bytes) == 0
    one = dp_link_bytes_per_layer(shape, 16, 4, 64)
    assert one["attention"] == 2 * 3 / 4 * 64 * shape.hidden_size * 2
    assert dp_link_bytes_per_layer(shape, 16, 4, 128)["dispatch"] == 2 * one["dispatch"]
    assert padded_rows([9, 2]) == 7 and padded_rows([4, 4]) == 0


@pytest.mark.skipif(not compile_targets.libtpu_available(), reason=compile_targets.LIBTPU_HINT)
def test_the_aot_plans_deepseek_v3_with_a_kv_pool_split_over_the_data_ranks():
    """DeepSeek-V3 on 64 v5p chips (abstract build, nothing compiled): TP attention keeps
    the whole latent pool on every chip; DP 16 x TP 4 keeps 1 / 16 of it a chip."""
    from lp_jax.aot import AotConfig, build

    cfg, aot = load_config("deepseek-v3"), dict(platform="tpu", topology="v5p:4x4x4",
                                                max_model_len=8192, max_num_seqs=64)
    tp, dp = (build(cfg, AotConfig(mesh_shape=mesh, **aot)) for mesh in ((1, 1, 64),
                                                                         (16, 1, 4)))
    assert dp.args[1].sharding.spec[0] == "data" and tp.args[1].sharding.spec[0] is None
    assert dp.kv_bytes_per_device * 16 == tp.kv_bytes_per_device
    assert dp.model_config.kv_ranks == 16


@pytest.mark.skipif(not compile_targets.libtpu_available(), reason=compile_targets.LIBTPU_HINT)
def test_deepseek_v3_steps_trace_in_bfloat16():
    """DeepSeek-V3's attention half keeps the model's dtype (its reference attention
    returns float32), so run_units' skip-or-run branches agree and the pod-scale AOT, which
    runs bfloat16, can lower the step. The CPU engines run float32 and never see it. The
    AOT serves the TPU MLA kernel on each rank (the preset with the kernel's latent width),
    inside the ranks' shard_map: a pallas_call in the step."""
    import jax

    from lp_jax.aot import AotConfig, _abstract_counts, _abstract_inputs, build

    b = build(load_config(str(ensure_tiny(preset="tiny-deepseek-a128"))), AotConfig(
        platform="tpu", topology="v6e:2x2", mesh_shape=(2, 1, 1), dtype="bfloat16",
        max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, token_buckets=(20,)))
    with jax.set_mesh(b.mesh):
        traced = jax.jit(b.step).trace(*b.args, _abstract_inputs(b.spec, 20, b.mesh),
                                       _abstract_counts(b))
    assert "lp_tpu_mla_decode" in str(traced.jaxpr)


@pytest.mark.skipif(not compile_targets.libtpu_available(), reason=compile_targets.LIBTPU_HINT)
def test_the_audit_counts_a_programs_rows_over_every_rank():
    """Rule 3 (temporaries below one layer's experts) holds for decode-sized programs.
    Under DP a bucket of N runs N rows on each rank: N = 4 on 2 ranks is 8 rows, past
    max_num_seqs = 4, so its temporaries are a prefill's; N = 2 (4 rows) is decode-sized."""
    from lp_jax.aot import AotConfig, build
    from lp_jax.aot.audit import audit_program

    b = build(load_config(str(ensure_tiny(preset="tiny-deepseek"))), AotConfig(
        platform="tpu", topology="v6e:2x2", mesh_shape=(2, 1, 1), max_model_len=64,
        max_num_seqs=4, max_num_batched_tokens=16, token_buckets=(20,)))
    huge = {"temp": 2**40, "alias": 2**40, "argument": 0, "output": 0}

    def temporaries(rows: int) -> list[str]:
        rec = {"rows": rows, "stablehlo": "", "memory": huge}
        return [v for v in audit_program(rec, b)["violations"] if v.startswith("temporaries")]

    assert b.spec.rows_for(4) == 8 and not temporaries(4)
    assert temporaries(2)


def test_a_full_rank_preempts_only_its_own_sequences():
    """Rank 0's two 8-token sequences need a third page each at once while the global
    tail (the lowest priority) sits on rank 1, whose shorter sequences need none yet: the
    preemption takes rank 0's tail, whose pages help, and leaves rank 1 alone."""
    from lp_jax.core.plan import StepResult
    from lp_jax.core.scheduler import Scheduler

    sched = Scheduler(make_sched_cfg("chunked", num_pages=8, data_parallel_size=2,
                                     max_num_seqs=4))
    seqs = [make_seq(i, list(range(10 * i + 1, 10 * i + 1 + n)), max_tokens=7, priority=p)
            for i, (n, p) in enumerate(((8, 0), (5, 0), (8, 0), (5, 1)))]
    for s in seqs:
        sched.add(s)
    now, ranks = 0.0, None
    while not any(s.num_preemptions for s in seqs):
        now += 1.0
        plan = sched.schedule(now)
        ranks = ranks or [sched.block_manager.rank_of(s) for s in seqs]
        sched.commit(plan, StepResult(tokens={s.seq_id: 5 for s in plan.sampling_seqs}), now)
    assert ranks == [0, 1, 0, 1]
    assert [s.num_preemptions for s in seqs] == [0, 0, 1, 0]
