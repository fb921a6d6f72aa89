"""The simulator's model of data-parallel attention beside expert parallelism
(lp_jax/sim/dp_executor.py): DeepSeek-V3 FP8 on 64 TPU v6e chips, DP 16 x TP 4 (and DP 2
x TP 4 for the step costs). Host-only, milliseconds each."""

import pytest

from lp_jax.core.plan import StepPlan
from lp_jax.roofline.dp_attention import dp_chip_layout, dp_link_bytes_per_layer
from lp_jax.roofline.hardware import get_hardware
from lp_jax.roofline.model_shape import DEEPSEEK_V3, LLAMA3_8B
from lp_jax.sim import Request, SimConfig, Simulator, simulate
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


def test_the_step_waits_for_the_busiest_rank():
    """SPMD: one decode alone costs what one decode on each rank costs (the idle rank pads
    to the busy one's rows), and two decodes on one rank cost more than one a rank."""
    ex = DPCostModelExecutor(SHAPE, HW, dp=2, tp=4)
    a, b = (make_seq(i, 4000, decoding=True) for i in range(2))
    two = StepPlan(step_id=0, num_layers=SHAPE.num_layers, decode=(a, b))
    ex.rank_of = lambda s: s.seq_id  # a on rank 0, b on rank 1
    spread = ex.run(two).seconds
    assert ex.balance(two)["padded"] == 0
    one = StepPlan(step_id=1, num_layers=SHAPE.num_layers, decode=(a,))
    assert ex.run(one).seconds == pytest.approx(spread, rel=1e-12)
    assert ex.balance(one) == pytest.approx(dict(
        rows=SHAPE.num_layers, padded=SHAPE.num_layers,
        link_bytes=ex.balance(two)["link_bytes"]))
    ex.rank_of = lambda s: 0  # both on rank 0
    assert ex.run(two).seconds > spread * 1.05
    # The link bytes a layer are the roofline's DP terms at the busiest rank's rows.
    link = dp_link_bytes_per_layer(SHAPE, 2, 4, 2)
    moe = SHAPE.num_moe_layers / SHAPE.num_layers
    assert ex.balance(two)["link_bytes"] == pytest.approx(SHAPE.num_layers * (
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
    # each rank ran the same rows (a layered chunk counted once for each layer group's
    # plan, as the engine counts it: a batch of 16 prompts gets more groups than one)
    assert len({many.extra[f"dp_rows_{r}"] for r in range(16)}) == 1
    # the same rows a rank each step: sixteen requests take the lone one's time, but for
    # the experts their rows activate
    assert one.span_s <= many.span_s < 1.5 * one.span_s
