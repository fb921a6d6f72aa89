"""The simulator calibrated on compiled programs (issue #26 §4), host-only, no compiles:
hand-made compiled-prediction files scale the executor's step times by the stated
factors (checked against the analytic ops priced independently), interpolate between
buckets, and bad or missing files, models, chips and meshes are refused by name."""

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from lp_jax.core.plan import PrefillChunk, StepPlan
from lp_jax.core.sequence import Sequence
from lp_jax.roofline import QWEN3_30B_A3B, ModelShape, get_hardware
from lp_jax.roofline.cost_model import StepTokens, layer_cost
from lp_jax.roofline.routing import ZipfRouting
from lp_jax.sim import Calibration, CostModelExecutor, SimConfig, Simulator
from lp_jax.sim.compiled_cost import FORMAT, TERMS, CompiledCalibration, terms_of
from lp_jax.sim.compiled_executor import CompiledCostExecutor

H200 = get_hardware("h200")
SMALL = ModelShape(
    name="small-moe", hidden_size=256, num_layers=4, num_q_heads=4, num_kv_heads=2,
    head_dim=64, vocab_size=1000, num_experts=16, top_k=2, expert_width=128,
)  # fmt: skip
CAL = Calibration(0.6, 0.8)  # no overheads: a step is its ops
SHAPE_KEYS = ("hidden_size", "num_layers", "num_q_heads", "num_kv_heads", "head_dim",
              "vocab_size", "num_experts", "top_k", "expert_width", "dense_width")


def _file(tmp_path, factors_by_rows: dict[int, dict[str, float]], **over) -> Path:
    """A compiled-prediction file whose term factors are the given ones (analytic 1 ms)."""
    d = {"format": FORMAT, "model": "small", "hardware": H200.name, "mesh": [1, 1, 1],
         "shape": {k: getattr(SMALL, k) for k in SHAPE_KEYS}, "eff_compute": 0.6,
         "eff_mem": 0.8, "source": "hand-made",
         "programs": [{"rows": r, "compiled_s": {t: 1e-3 * f.get(t, 1.0) for t in TERMS},
                       "analytic_s": dict.fromkeys(TERMS, 1e-3)}
                      for r, f in factors_by_rows.items()]}
    d.update(over)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(d))
    return path


def _executors(cc: CompiledCalibration):
    base = CostModelExecutor(SMALL, H200, calibration=CAL)
    return base, CompiledCostExecutor(SMALL, H200, compiled=cc, calibration=CAL)


def _decode(B: int, ctx: int) -> StepPlan:
    return StepPlan(0, SMALL.num_layers,
                    decode=tuple(Sequence(i, [1] * ctx) for i in range(B)))


def _ops(step: StepTokens) -> dict[str, float]:
    """Seconds per analytic op over the stack, priced here from cost_model directly."""
    lc = layer_cost(SMALL, step, layer=0, routing=ZipfRouting())
    out = {}
    for op in lc.ops:
        out[op.name] = SMALL.num_layers * CAL.op_seconds(
            (op.flops + op.pad_flops) / H200.peak_flops, op.bytes / H200.hbm_bw)
    return out


def test_uniform_factor_scales_every_step_by_it(tmp_path):
    cc = CompiledCalibration.load(_file(tmp_path, {1: dict.fromkeys(TERMS, 2.5)}))
    base, comp = _executors(cc)
    long = Sequence(99, [1] * 300)
    plans = [_decode(4, 200),
             StepPlan(0, SMALL.num_layers, decode=_decode(3, 50).decode,
                      prefill=(PrefillChunk(long, 0, 256),), prefill_batch_id=0)]
    for plan in plans:
        b, c = base.run(plan), comp.run(plan)
        assert c.seconds == pytest.approx(2.5 * b.seconds, rel=1e-9)
        assert (c.flops, c.hbm_bytes, c.expert_bytes) == (b.flops, b.hbm_bytes, b.expert_bytes)


def test_per_term_factor_moves_only_its_ops(tmp_path):
    cc = CompiledCalibration.load(_file(tmp_path, {1: {"attention": 4.0, "experts": 1.5}}))
    base, comp = _executors(cc)
    B, ctx = 8, 300
    plan = _decode(B, ctx)
    ops = _ops(StepTokens(decode_seqs=B, decode_context=ctx))
    # the independent price of the same step: lm_head is outside the layers
    expected_gain = 3.0 * ops["attn_decode"] + 0.5 * ops["experts"]
    gain = comp.run(plan).seconds - base.run(plan).seconds
    assert gain == pytest.approx(expected_gain, rel=1e-6)
    assert gain > 0


def test_factor_interpolates_in_log_rows_and_clamps(tmp_path):
    cc = CompiledCalibration.load(_file(tmp_path, {1: {"layer_rest": 1.0},
                                                   100: {"layer_rest": 3.0}}))
    assert cc.factor("layer_rest", 10) == pytest.approx(2.0)
    assert cc.factor("layer_rest", 1) == pytest.approx(1.0)
    assert cc.factor("layer_rest", 5000) == pytest.approx(3.0)
    assert cc.factor("attention", 10) == pytest.approx(1.0)
    with pytest.raises(KeyError, match="unknown term"):
        cc.factor("softmax", 4)
    base, comp = _executors(cc)
    B = 10
    ops = _ops(StepTokens(decode_seqs=B, decode_context=64))
    rest = sum(ops[n] for n in ("qkv_proj", "o_proj", "router") if n in ops)
    gain = comp.run(_decode(B, 64)).seconds - base.run(_decode(B, 64)).seconds
    assert gain == pytest.approx((2.0 - 1.0) * rest, rel=1e-6)


def test_simulator_option_uses_the_files_factors_and_efficiencies(tmp_path):
    cc = CompiledCalibration.load(_file(tmp_path, {1: dict.fromkeys(TERMS, 2.0)}))
    sim = Simulator(SimConfig(shape=SMALL, hardware=H200, compiled_cost=cc, num_pages=256))
    assert isinstance(sim.executor, CompiledCostExecutor)
    cal = sim.executor.calibration
    assert (cal.compute_efficiency, cal.bandwidth_efficiency) == (0.6, 0.8)
    plain = Simulator(SimConfig(shape=SMALL, hardware=H200, calibration=cal, num_pages=256))
    plan = _decode(4, 100)
    over = cal.overhead_s + cal.layer_overhead_s * SMALL.num_layers
    assert sim.executor.run(plan).seconds - over == pytest.approx(
        2.0 * (plain.executor.run(plan).seconds - over), rel=1e-9)
    other = sim.executor.with_calibration(CAL)
    assert isinstance(other, CompiledCostExecutor)


@pytest.mark.parametrize("edit, match", [
    ({"format": "something/else"}, "not a compiled calibration"),
    ({"programs": []}, "at least one program"),
    ({"eff_mem": 1.5}, "eff_mem"),
    ({"mesh": [1, 1]}, "mesh"),
])
def test_bad_files_are_refused(tmp_path, edit, match):
    with pytest.raises(ValueError, match=match):
        CompiledCalibration.load(_file(tmp_path, {1: {}}, **edit))


def test_bad_program_entries_are_refused(tmp_path):
    path = _file(tmp_path, {1: {}, 8: {}})
    d = json.loads(path.read_text())
    cases = [
        (lambda d: d["programs"][0]["compiled_s"].pop("experts"), "malformed"),
        (lambda d: d["programs"][1].update(rows=1), "distinct"),
        (lambda d: d["programs"][0]["compiled_s"].update(attention=-1.0), "finite and >= 0"),
        (lambda d: d["programs"][0]["analytic_s"].update(outside=0.0), "no analytic"),
        (lambda d: d["programs"][0]["analytic_s"].update(outside=math.nan), "finite"),
        (lambda d: d.pop("shape"), "missing"),
    ]
    for edit, match in cases:
        bad = json.loads(json.dumps(d))
        edit(bad)
        path.write_text(json.dumps(bad).replace("NaN", "NaN"))
        with pytest.raises(ValueError, match=match):
            CompiledCalibration.load(path)


def test_missing_and_non_json_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        CompiledCalibration.load(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        CompiledCalibration.load(tmp_path / "bad.json")


def test_other_model_chip_or_mesh_refused(tmp_path):
    cc = CompiledCalibration.load(_file(tmp_path, {1: {}}))
    with pytest.raises(ValueError, match="does not fit"):
        CompiledCostExecutor(QWEN3_30B_A3B, H200, compiled=cc)
    with pytest.raises(ValueError, match="is for H200"):
        CompiledCostExecutor(SMALL, get_hardware("v6e"), compiled=cc)
    with pytest.raises(ValueError, match="expert 1 x tensor 1"):
        CompiledCostExecutor(SMALL, H200, compiled=cc, ep=2)


def test_terms_pool_the_layer_ops_the_compiler_files_elsewhere():
    """XLA:GPU's one-row matvecs land in "other": layer_rest pools them with the matmuls."""
    zero = dict.fromkeys(("attention", "experts", "dense matmuls", "logits/sampling",
                          "collectives", "other"), 0.0)
    body = SimpleNamespace(by_class={**zero, "attention": 1.0, "experts": 2.0,
                                     "other": 3.0, "collectives": 0.5})
    outside = SimpleNamespace(by_class={**zero, "logits/sampling": 4.0, "other": 1.0})
    analytic = {**zero, "attention": 10.0, "experts": 20.0, "dense matmuls": 7.0,
                "logits/sampling": 2.0}
    r = SimpleNamespace(rows=1, bodies={"moe": (10, body)}, outside=outside,
                        analytic_by_class=analytic)
    t = terms_of(r)
    assert t.factor("attention") == pytest.approx(1.0)
    assert t.factor("experts") == pytest.approx(1.0)
    assert t.factor("layer_rest") == pytest.approx(35.0 / 7.0)
    assert t.factor("outside") == pytest.approx(2.5)


def test_committed_calibrations_fit_their_machines():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
    import reproduce_paper as rp

    files = sorted(rp.COMPILED_DIR.glob("*.json"))
    assert files
    for path in files:
        model, _, machine = path.stem.partition("_")
        cost = rp.compiled_cost(rp.MACHINES[machine], model)
        assert cost.compiled.rows[0] == 1
        assert all(f > 0 for p in cost.compiled.programs for f in map(p.factor, TERMS))
