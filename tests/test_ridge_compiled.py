"""The ridge recheck on compiled MoE programs (lp_jax/roofline/ridge_compiled.py): the
crossing of a sweep's intensity with the ridge, on synthetic series whose crossing is
known by hand, and the cost of a hand-written one-layer HLO. Host-only: no compiles."""

import json
import math

import pytest

from lp_jax.roofline.hardware import get_hardware
from lp_jax.roofline.model_shape import ModelShape
from lp_jax.roofline.ridge_compiled import (
    LayerCost,
    beyond_sweep,
    crossing,
    declared_kernel_cost,
    expert_weight_bytes,
    formula_knees,
    intensity_table,
    layer_cost,
    markdown_table,
    results_json,
    sweep_crossings,
)

ROWS = [16, 32, 64, 128, 256, 512, 1024]


def test_a_power_law_crosses_where_solved_by_hand():
    # I(r) = 0.25 * sqrt(r) reaches 5 at sqrt(r) = 20, r = 400; log-log interpolation is
    # exact on a power law, and 512 is the first sample at or above.
    got = crossing(ROWS, [0.25 * math.sqrt(r) for r in ROWS], ridge=5.0)
    assert got.crosses
    assert got.rows == pytest.approx(400.0, rel=1e-12)
    assert got.first_sampled == 512
    assert got.max_rows == 1024 and got.max_intensity == pytest.approx(8.0)


def test_the_crossing_interpolates_between_the_bracketing_samples_only():
    # Flat, then a jump between 64 and 128 from 2 to 8: ridge 4 is halfway in log
    # intensity, so halfway in log rows: sqrt(64 * 128).
    series = [1, 1.5, 2, 8, 9, 10, 11]
    got = crossing(ROWS, series, ridge=4.0)
    assert got.rows == pytest.approx(math.sqrt(64 * 128))
    assert got.first_sampled == 128


def test_a_series_that_never_reaches_the_ridge_never_crosses():
    series = [300 * r / (r + 2000) for r in ROWS]  # saturates at 300, below a 400 ridge
    got = crossing(ROWS, series, ridge=400.0)
    assert not got.crosses and math.isinf(got.rows) and got.first_sampled is None
    assert got.max_intensity == pytest.approx(series[-1]) and got.max_rows == 1024


def test_a_series_above_the_ridge_from_its_first_sample_crosses_at_most_there():
    got = crossing(ROWS, [10.0 * r for r in ROWS], ridge=50.0)
    assert got.rows == 16 and got.first_sampled == 16


@pytest.mark.parametrize("rows, series, ridge", [
    ([16, 32], [1.0], 5.0),  # unequal lengths
    ([16], [1.0], 5.0),  # one point
    ([32, 16], [1.0, 2.0], 5.0),  # decreasing rows
    ([16, 16], [1.0, 2.0], 5.0),  # repeated rows
    ([0, 16], [1.0, 2.0], 5.0),  # non-positive rows
    ([16, 32], [1.0, 0.0], 5.0),  # a zero intensity
    ([16, 32], [1.0, math.nan], 5.0),
    ([16, 32], [1.0, 2.0], 0.0),  # no ridge
    ([16, 32], [1.0, 2.0], math.inf),
])
def test_bad_input_is_refused(rows, series, ridge):
    with pytest.raises(ValueError):
        crossing(rows, series, ridge)


@pytest.mark.parametrize("field", ["flops", "bytes", "weight_bytes"])
def test_a_layer_cost_needs_positive_figures(field):
    good = dict(rows=16, flops=1e9, bytes=1e8, weight_bytes=5e7)
    LayerCost(**good)
    with pytest.raises(ValueError, match=field):
        LayerCost(**{**good, field: 0.0})
    with pytest.raises(ValueError):
        LayerCost(**{**good, "rows": 0})


def _costs(bytes_per_row: float, weight: float, flop_per_row: float = 1e6):
    return [LayerCost(rows=r, flops=flop_per_row * r, bytes=weight + bytes_per_row * r,
                      weight_bytes=weight) for r in ROWS]


def test_sweep_crossings_of_weight_bytes_come_before_those_of_all_bytes():
    # flops = 1e6 r; weights 1e6 B: I_w = r, crossing the ridge R at r = R exactly when
    # interpolated between samples (linear in log-log). All bytes add 1e3 B a row:
    # I = 1e6 r / (1e6 + 1e3 r) reaches 200 at r = 250 (solved by hand), so the
    # interpolated crossing lies between the samples 128 and 256.
    hw = get_hardware("h200")  # ridge 206.1
    got = sweep_crossings(list(reversed(_costs(1e3, 1e6))), hw)  # order does not matter
    assert got["weight bytes"].rows == pytest.approx(hw.ridge_point, rel=1e-9)
    exact = hw.ridge_point * 1e6 / (1e6 - 1e3 * hw.ridge_point)  # solve r: I(r) = ridge
    assert 256 < exact < 512
    assert got["all bytes"].first_sampled == 512
    assert 256 < got["all bytes"].rows < 512
    assert got["all bytes"].rows > got["weight bytes"].rows


def test_the_kernels_alone_cross_where_their_own_series_does():
    # program I = 20 sqrt(r); the kernels do all its flops over half its bytes, so
    # theirs is 40 sqrt(r): the ridge R is reached at (R / 20)^2 and (R / 40)^2 rows
    costs = [LayerCost(rows=r, flops=20 * math.sqrt(r) * 1e6, bytes=1e6, weight_bytes=1e6,
                       kernel_flops=20 * math.sqrt(r) * 1e6, kernel_bytes=5e5) for r in ROWS]
    hw = get_hardware("h200")
    got = sweep_crossings(costs, hw)
    assert got["all bytes"].rows == pytest.approx((hw.ridge_point / 20) ** 2)
    assert got["kernels"].rows == pytest.approx((hw.ridge_point / 40) ** 2)
    assert "kernels" not in sweep_crossings(_costs(1e3, 1e6), hw)  # none recorded


def test_past_the_sweep_the_last_two_samples_extend_linearly():
    # flops 1e6 r, bytes 1e6 + 1e3 r: the asymptote is 1e6 / 1e3 = 1000, and the
    # extension reaches a ridge of 500 where 1e6 r = 500 (1e6 + 1e3 r): r = 1000,
    # beyond the last sample (1024 rows: I = 506 there, so pick a sweep ending lower).
    costs = _costs(1e3, 1e6)[:5]  # 16 .. 256 rows, I(256) = 204
    got = beyond_sweep(costs, 500.0)
    assert got.asymptote == pytest.approx(1000.0)
    assert got.rows == pytest.approx(1000.0)
    assert math.isinf(beyond_sweep(costs, 1000.0).rows)  # the asymptote never reaches it
    # weight bytes stop growing: the weight intensity is 1e6 r / 1e6 = r, so ridge R at R
    flat = beyond_sweep(costs, 400.0, weight=True)
    assert math.isinf(flat.asymptote) and flat.rows == pytest.approx(400.0)
    with pytest.raises(ValueError):
        beyond_sweep(costs[:1], 400.0)
    with pytest.raises(ValueError):
        beyond_sweep(costs, 0.0)


SHAPE = ModelShape(name="tiny", hidden_size=64, num_layers=1, num_q_heads=2, num_kv_heads=2,
                   head_dim=32, vocab_size=256, num_experts=8, top_k=2, expert_width=32,
                   dtype_bytes=2)
T, D, E, F, K = 16, 64, 8, 32, 2

SIGNATURE = (f"(x: f32[{T},{D}], g: f32[{D},{E}], h: bf16[{T * K},{F}], "
             f"w: bf16[{E},{F},{D}]) -> bf16[{T * K},{D}]")
DECLARED = ('{"custom_call_config":{"cost_estimate":{"flops":"123","transcendentals":"0",'
            '"bytes_accessed":"456","remote_bytes_transferred":"0"}}}')
HLO = f"""HloModule moe_layer

ENTRY %main {SIGNATURE} {{
  %x = f32[{T},{D}]{{1,0}} parameter(0)
  %g = f32[{D},{E}]{{1,0}} parameter(1)
  %h = bf16[{T * K},{F}]{{1,0}} parameter(2)
  %w = bf16[{E},{F},{D}]{{2,1,0}} parameter(3)
  %router = f32[{T},{E}]{{1,0}} dot(%x, %g), lhs_contracting_dims={{1}}, \
rhs_contracting_dims={{0}}
  ROOT %lp_tpu_moe_down.1 = bf16[{T * K},{D}]{{1,0}} custom-call(%h, %w), \
custom_call_target="tpu_custom_call", backend_config={DECLARED}
}}
"""


def test_layer_cost_of_a_hand_written_program():
    hw = get_hardware("v6e")
    got = layer_cost(HLO, SHAPE, T, hw)
    # counted by hand: the router dot, then the down kernel under uniform routing (its
    # routed rows in and out, each active expert's [F, D] weight once)
    router_flops, router_bytes = 2 * T * D * E, 4 * (T * D + D * E + T * E)
    rows = T * K
    active = E * (1 - (1 - K / E) ** T)
    kernel_flops = 2 * rows * F * D
    kernel_bytes = rows * F * 2 + rows * D * 2 + active * F * D * 2
    assert got.kernel_flops == kernel_flops
    assert got.kernel_bytes == pytest.approx(kernel_bytes, abs=1)
    assert got.flops == router_flops + kernel_flops
    assert got.bytes == pytest.approx(router_bytes + kernel_bytes, abs=1)
    # weight bytes: the active experts' gate/up [D, 2F] and down [F, D]
    assert got.weight_bytes == pytest.approx(active * 3 * D * F * 2)
    assert declared_kernel_cost(HLO)[0].flops == 123
    assert declared_kernel_cost(HLO)[0].bytes_accessed == 456


def test_a_program_without_the_moe_kernels_is_refused():
    plain = HLO.replace('custom_call_target="tpu_custom_call"', 'custom_call_target="foo"')
    with pytest.raises(ValueError, match="no Pallas MoE call"):
        layer_cost(plain, SHAPE, T, get_hardware("v6e"))
    assert declared_kernel_cost(HLO.replace("cost_estimate", "x")) == []


def test_expert_weight_bytes_saturate_at_every_expert():
    every = 8 * 3 * 64 * 32 * 2
    assert expert_weight_bytes(SHAPE, 10_000) == pytest.approx(every)
    assert expert_weight_bytes(SHAPE, 1) == pytest.approx(2 / 8 * every)  # k of E


def test_table_and_json_name_a_chip_that_never_crosses():
    h200, v6e = get_hardware("h200"), get_hardware("v6e")
    results = {
        "h200": {"hardware": h200, "costs": _costs(1e3, 1e6), "knees": formula_knees(SHAPE, h200)},
        "v6e": {"hardware": v6e, "costs": _costs(1e4, 1e6), "knees": formula_knees(SHAPE, v6e)},
    }
    table = markdown_table(results)
    h200_row = next(line for line in table.splitlines() if line.startswith("| h200"))
    v6e_row = next(line for line in table.splitlines() if line.startswith("| v6e"))
    assert "never" not in h200_row.split("|")[3]
    assert "never (asymptote 100 < ridge)" in v6e_row.split("|")[3]  # 1e6 / 1e4 < 560
    data = json.loads(results_json(results), parse_constant=pytest.fail)  # strict JSON
    assert data["v6e"]["knees"]["exact uniform"] is None  # 3F/a = 48 < 560: never
    assert data["v6e"]["crossings"]["all bytes"]["rows"] is None
    assert 256 < data["h200"]["crossings"]["all bytes"]["rows"] < 512
    assert [c["rows"] for c in data["h200"]["costs"]] == ROWS
    assert data["v6e"]["beyond_sweep"]["all bytes"]["asymptote"] == pytest.approx(100.0)
    grid = intensity_table(results).splitlines()
    assert len(grid) == 2 + len(ROWS) and grid[2].startswith("| 16 |")
