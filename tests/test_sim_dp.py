"""The simulator's model of data-parallel attention beside expert parallelism
(lp_jax/sim/dp_executor.py): DeepSeek-V3 FP8 on 64 TPU v6e chips, DP 16 x TP 4 (and DP 2
x TP 4 for the step costs). Host-only, milliseconds each."""

import pytest

from lp_jax.core.plan import PrefillChunk, StepPlan
from lp_jax.roofline.dp_attention import dp_chip_layout, dp_link_bytes_per_layer
from lp_jax.roofline.hardware import get_hardware
from lp_jax.roofline.model_shape import DEEPSEEK_V3, LLAMA3_8B
from lp_jax.sim import CostModelExecutor, Request, SimConfig, Simulator, simulate
from lp_jax.sim.dp_executor import DPCostModelExecutor
from tests.conftest import make_seq

SHAPE, HW = DEEPSEEK_V3.with_formats("fp8_block", None), get_hardware("TPU v6e")


def _config(**kw):
    return SimConfig(shape=SHAPE, hardware=HW, **{"policy": "chunked", "dp": 16, "tp": 4, **kw})


def test_each_rank_gets_one_chips_kv_room_and_its_own_pool():
    """The pool is d ranks of one chip's room beside the (d, 1, t) weights, and the
    scheduler splits it: a request that fits the pool but not one rank's share is refused."""
    sim = Simulator(_config())
    per_rank = dp_chip_layout(SHAPE, 16, 4).kv_tokens(HW.hbm_bytes) // 16
    assert sim.num_pages == 16 * per_rank and per_rank > 1000
    sched = Simulator(_config(num_pages=16 * 4, page_size=16)).make_scheduler()
    assert sched.config.data_parallel_size == 16
    with pytest.raises(ValueError, match="a data-parallel rank's pool has only 4"):
        sched.add(make_seq(0, 80, max_tokens=1))  # 5 pages of the 64
    sched.add(make_seq(1, 64, max_tokens=1))
    with pytest.raises(ValueError, match="ep 1"):
        _config(ep=2)
    with pytest.raises(ValueError, match="has none"):
        DPCostModelExecutor(LLAMA3_8B, HW, dp=2)
    with pytest.raises(ValueError, match="needs a DPCostModelExecutor"):
        Simulator(_config(), executor=CostModelExecutor(SHAPE, HW, tp=4, ep=16))


def test_the_step_waits_for_the_busiest_rank():
    """SPMD: the same rows cost more packed on one rank than spread one a rank (the other
    rank pads to the busy one's rows); the padding and the link bytes are counted."""
    ex = DPCostModelExecutor(SHAPE, HW, dp=2, tp=4)
    L = SHAPE.num_layers
    a, b = (make_seq(i, 4000, decoding=True) for i in range(2))
    two = StepPlan(step_id=0, num_layers=L, decode=(a, b))
    ex.rank_of = lambda s: s.seq_id % 2  # a on rank 0, b on rank 1
    spread, spread_bal = ex.run(two).seconds, ex.balance(two)
    assert spread_bal["rows"] == 2 * L and spread_bal["padded"] == 0
    ex.rank_of = lambda s: 0  # both on rank 0
    assert ex.run(two).seconds > spread  # rank 0 reads both sequences' KV
    assert ex.balance(two)["padded"] == 2 * L
    # Prefill: 2,048 tokens as one chunk on one rank, or 1,024 on each.
    c, d = (make_seq(i, 2048) for i in (2, 3))
    lone = StepPlan(step_id=1, num_layers=L, prefill_batch_id=0,
                    prefill=(PrefillChunk(c, 0, 2048),))
    halves = StepPlan(step_id=2, num_layers=L, prefill_batch_id=0,
                      prefill=(PrefillChunk(c, 0, 1024), PrefillChunk(d, 0, 1024)))
    ex.rank_of = lambda s: s.seq_id % 2
    # The packed rank runs twice the rows' dense work and four times the attention pairs
    # while the experts are read once either way: 1.25x under the MLA analytic model.
    assert ex.run(lone).seconds > 1.15 * ex.run(halves).seconds
    assert ex.balance(lone)["padded"] == 2048 * L and ex.balance(halves)["padded"] == 0
    # The link bytes a layer are the roofline's DP terms at the busiest rank's rows.
    link = dp_link_bytes_per_layer(SHAPE, 2, 4, 1)
    moe = SHAPE.num_moe_layers / L
    assert spread_bal["link_bytes"] == pytest.approx(L * (
        link["attention"] + moe * (link["dispatch"] + link["combine"] + link["gather"])))


@pytest.mark.parametrize("policy", ["chunked", "layered"])
def test_a_lone_request_leaves_fifteen_ranks_padding(policy):
    """One request on DP 16: every row it runs, the other 15 ranks pad; sixteen requests
    at once spread one a rank and finish when the lone one does."""
    cfg = _config(policy=policy, max_num_batched_tokens=2048)
    one = simulate(cfg, [Request(0.0, 100, 5)])
    assert one.metrics[0].num_tokens == 5
    assert one.extra["dp_padding"] == pytest.approx(15 / 16)
    assert one.extra["dp_imbalance"] == 16
    assert one.extra["dp_padded_rows"] == 15 * sum(one.extra[f"dp_rows_{r}"] for r in range(16))
    many = simulate(cfg, [Request(0.0, 100, 5)] * 16)
    assert many.extra["dp_padding"] == 0 and many.extra["dp_imbalance"] == 1
    # each rank ran the lone request's rows (a layered chunk is counted once for each
    # layer group's plan, as the engine counts it, and the groups follow a rank's tokens:
    # one prompt a rank gets the lone prompt's groups)
    lone = sum(one.extra[f"dp_rows_{r}"] for r in range(16))
    assert [many.extra[f"dp_rows_{r}"] for r in range(16)] == [lone] * 16
    # the same rows a rank each step: sixteen requests take the lone one's time, but for
    # the experts their rows activate
    assert one.span_s <= many.span_s < 1.5 * one.span_s
