"""The sglang-jax comparison's reading of stored HLO: its kernels costed by cost.py, the
1- and 2-layer difference, and the table (no sglang-jax, no compile)."""

import importlib.util
import json
from pathlib import Path

import pytest

from lp_jax.bench import compare_sglang_jax as csj
from lp_jax.roofline import compiled, hlo
from lp_jax.roofline.hardware import get_hardware
from lp_jax.roofline.model_shape import ModelShape
from pallas_kernels import cost

DATA = Path(__file__).parent / "data" / "compare_sglang_jax"
SHAPE = ModelShape.from_json(Path(__file__).parents[1] / "checkpoints/configs/Qwen3-30B-A3B.json")
HW = get_hardware("v6e")
P8 = csj.program("decode", 8, SHAPE, max_model_len=4096, page_size=16, tp=8, ep=1)


def text(name: str) -> str:
    return (DATA / name).read_text()


def test_sglang_kernels_are_named_and_costed_by_cost_py():
    raw = text("sglang_1L_decode8_model.hlo.txt")
    # gmm_v2 writes its configuration over several lines: the parser reads on past them
    assert "\n}" in raw.split("kernel_metadata=", 1)[1].split("metadata=", 1)[0]
    module = hlo.parse(raw)
    assert "logits" in module.computations["main.1"].instrs
    entry = module.computations[module.entry]
    gmm, rpa = entry.instrs["gmm_v2.0"], entry.instrs["RPAd-p_16-bq_1_1-bkv_4096_4096.0"]
    mixed = entry.instrs["RPAm-p_16-bq_4_4-bkv_1024_512.0"]
    assert csj.sglang_kernel(gmm) == ("gmm", {"g": 16, "m": 64, "k": 2048, "n": 768})
    assert csj.sglang_kernel(rpa) == ("rpa", {"case": "d"})
    assert csj.sglang_kernel(entry.instrs["all-reduce.0"]) is None
    # lp_jax's own walker knows no sglang-jax kernel: costing it is this module's job
    with pytest.raises(KeyError, match="names no kernel"):
        compiled.Walker(module, P8, HW, 0.6, 0.8).walk(entry, {}, top=False)
    walker = csj.BasisWalker(module, P8, HW, 0.6, 0.8)
    op = walker.op(entry, gmm)
    want = cost.moe_matmul(tokens=8, top_k=8, experts=128, k=2048, n=768, glu=False,
                           lhs_itemsize=2, w_itemsize=2, out_itemsize=2)
    # uniform routing over the experts, the call's 16 of 128 on this device; not the
    # declared m=64 rows x all 16 local experts' weights
    assert op.cls == "experts" and op.flops == pytest.approx(want.flops / 8)
    assert op.bytes == pytest.approx(want.bytes_accessed / 8)
    # a decode step's attention is charged once, to the decode case's call
    att = walker.op(entry, rpa)
    assert (att.cls, att.bytes) == ("attention",
                                    compiled.kernel_cost(cost.TPU_ATTENTION, P8).bytes_accessed)
    assert walker.op(entry, mixed).bytes == 0
    prompt = csj.program("prefill", 512, SHAPE, max_model_len=4096, page_size=16, tp=8, ep=1)
    walker = csj.BasisWalker(module, prompt, HW, 0.6, 0.8)
    assert walker.op(entry, rpa).bytes == 0 and walker.op(entry, mixed).bytes > 0
    # a Pallas call no estimate names (the router's top-k) moves its operands and result
    topk = walker.op(entry, entry.instrs["topk.0"])
    assert (topk.tag, topk.bytes) == ("topk", 8 * 2048 * 2 + 8 * 8 * 8)


def _compile(engine, layers, texts):
    return csj.Compiled(engine, layers, "decode", 8, texts, 10.0 * layers,
                        1000 + 100 * layers, 50 * layers)


def test_per_layer_difference_treats_a_loop_and_unrolled_layers_alike():
    sg = [_compile("sglang-jax", n, [(text(f"sglang_{n}L_decode8_model.hlo.txt"), False)])
          for n in (1, 2)]
    got = csj.per_layer(*sg, P8, HW)
    layer, outside = got["layer"], got["outside"]
    assert {k: round(v) for k, v in layer.calls.items()} == {
        "sglang rpa_v3 (d)": 1, "sglang rpa_v3 (m)": 1, "topk": 1, "sglang gmm": 1,
        "all-reduce": 1}
    assert {k: round(v) for k, v in outside.calls.items() if round(v)} == {}
    # outside: the LM head dot only, 2 * 8 * 2048 * 18992 flops
    assert outside.flops == pytest.approx(2 * 8 * 2048 * 18992)
    assert got["argument_layer"] == 100 and got["argument_outside"] == 1000

    # lp_jax: one HLO, its layer loop's body counted once per layer
    lp = [_compile("lp_jax", n, [(text("lp_jax_decode8.hlo.txt"), True)]) for n in (1, 2)]
    got = csj.per_layer(*lp, P8, HW)
    assert {k: round(v) for k, v in got["layer"].calls.items()} == {
        "all-reduce": 1, cost.TPU_MOE_DOWN: 1}
    assert got["outside"].flops == pytest.approx(2 * 8 * 2048 * 18992)
    assert got["layer"].tag_bytes["all-reduce"] == 8 * 2048 * 2
    # a layer loop's costs come from the 2-layer program alone (a one-trip loop over a
    # one-layer stack compiles differently); the 1-layer compile gives argument bytes
    lp[0].hlo_texts = [(text("sglang_1L_decode8_model.hlo.txt"), False)]
    assert csj.per_layer(*lp, P8, HW)["layer"].calls == got["layer"].calls


def test_loaders_and_table(tmp_path):
    sg_dir = tmp_path / "sglang"
    sg_dir.mkdir()
    programs = []
    for n in (1, 2):
        (sg_dir / f"m{n}.hlo.txt").write_text(text(f"sglang_{n}L_decode8_model.hlo.txt"))
        part = {"hlo": f"m{n}.hlo.txt", "compile_s": 2.0,
                "memory": {"argument": 1000 + 100 * n, "temp": 7}}
        programs.append({"layers": n, "mode": "decode", "tokens": 8, "model": part,
                         "sampler": {**part, "compile_s": 1.0}})
    (sg_dir / "summary.json").write_text(json.dumps({"programs": programs}))
    loaded = csj.load_sglang(sg_dir)
    assert [c.compile_s for c in loaded] == [3.0, 3.0]  # the model and its sampler

    lp = {}
    for n in (1, 2):
        d = tmp_path / f"lp{n}"
        d.mkdir()
        (d / "program_8.hlo.txt").write_text(text("lp_jax_decode8.hlo.txt"))
        (d / "summary.json").write_text(json.dumps({
            "config": {"max_num_seqs": 128},
            "programs": [{"rows": 8, "optimized_hlo_file": "program_8.hlo.txt",
                          "compile_s": 3.0, "memory": {"argument": 500 * n, "temp": 9}}]}))
        lp[n] = d
    rows = csj.compare(csj.load_lp_jax(lp) + loaded, SHAPE, HW, max_model_len=4096,
                       page_size=16, tp=8, ep=1)
    assert [(r["mode"], r["tokens"]) for r in rows] == [("decode", 8)]
    table = csj.render(rows)
    assert "| argument MiB per layer |" in table and "| predicted ms per step, 48 layers |" in table
    assert "| compile s (2 layers) | 3.0 | 3.0 | 1.00 |" in table
    assert "sglang gmm 2" in table and "lp_tpu_moe_down 1" in table  # model + "sampler"


def test_the_harness_names_a_moved_sglang_jax_name():
    spec = importlib.util.spec_from_file_location(
        "sglang_jax_compile", Path(__file__).parents[1] / "launch" / "sglang_jax_compile.py")
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)  # stdlib imports only: it runs in sglang-jax's venv
    assert worker.require("json", "dumps") == [json.dumps]
    with pytest.raises(worker.MovedName, match=r"json\.no_such_name"):
        worker.require("json", "no_such_name")
    with pytest.raises(worker.MovedName, match="no_such_module is gone"):
        worker.require("no_such_module")


def test_a_fused_reduce_scatter_is_counted_as_one():
    """XLA:TPU writes a reduce-scatter as a fusion of an all-reduce and its slice (the
    row-split residual stream's o_proj): the table lists it among the collectives."""
    from tests.test_roofline_hlo import FUSED_REDUCE_SCATTER, R
    module = hlo.parse(FUSED_REDUCE_SCATTER)
    walker = csj.BasisWalker(module, P8, HW, 0.6, 0.8)
    entry = module.computations[module.entry]
    op = walker.op(entry, entry.instrs["rs"])
    assert (op.cls, op.tag) == ("collectives", "reduce-scatter")
    assert op.link_bytes == R * 64 * 4 / 2  # half an all-reduce of its operand
