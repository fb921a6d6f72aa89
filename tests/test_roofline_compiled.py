"""`python -m lp_jax.roofline --aot DIR`: the roofline of compiled programs.

Two tiny Qwen3-MoE programs (4 and 8 layers, one 64-row bucket) are compiled for a
v6e 2x2 slice by libtpu on this host, compile-only, at once. Their experts (100 MB
per layer per device) and KV pool are too large for XLA to prefetch a whole stack
into VMEM, as it does for smaller models (an honest cost, but one that grows with
the layer count).
"""

import dataclasses
import json
import threading

import pytest

from lp_jax.aot import AotConfig, load_config, run
from lp_jax.roofline import compiled
from lp_jax.roofline.__main__ import main as roofline_main
from pallas_kernels import cost
from pallas_kernels.compile_targets import libtpu_available

MOE = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 2048,
    "hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 1024,
    "moe_intermediate_size": 1024, "num_experts": 64, "num_experts_per_tok": 4,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 0,
}
ENGINE = dict(platform="tpu", topology="v6e:2x2", mesh_shape=(1, 2, 1), scheduling="layered",
              max_model_len=4096, max_num_seqs=16, max_num_batched_tokens=48,
              token_buckets=(64,))
pytestmark = pytest.mark.skipif(not libtpu_available(),
                                reason="libtpu is not installed: pip install -e '.[tpu]'")


@pytest.fixture(scope="module")
def aot_dirs(tmp_path_factory):
    """{layers: AOT output directory}, both compiled side by side (libtpu frees the GIL)."""
    dirs = {}

    def one(layers):
        d = tmp_path_factory.mktemp(f"moe{layers}")
        (d / "config.json").write_text(json.dumps(dict(MOE, num_hidden_layers=layers)))
        run(load_config(str(d)), AotConfig(**ENGINE), d / "aot", log=None)
        dirs[layers] = d / "aot"

    threads = [threading.Thread(target=one, args=(n,)) for n in (4, 8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(dirs) == {4, 8}, "a compile failed (its traceback is above)"
    return dirs


def test_aot_writes_the_optimized_hlo_and_xla_cost_analysis(aot_dirs):
    out = aot_dirs[4]
    prog = json.loads((out / "summary.json").read_text())["programs"][0]
    assert (out / prog["optimized_hlo_file"]).read_text().startswith("HloModule")
    assert prog["cost_analysis"]["flops"] > 0
    assert (out / "program_64.cost_analysis.json").is_file()
    kernels = {k["kernel"] for k in prog["pallas_estimates"]}
    assert kernels == {cost.TPU_ATTENTION, cost.TPU_MOE_GATE_UP_GATHER, cost.TPU_MOE_DOWN}


def test_the_layer_loop_is_split_off_and_counted_per_layer(aot_dirs):
    (_, _, [four]), (_, _, [eight]) = (compiled.read_aot(aot_dirs[n]) for n in (4, 8))
    # XLA counts the layer loop once: the same flops for 4 and 8 layers
    assert four.xla_flops == pytest.approx(eight.xla_flops, rel=0.01)
    assert eight.body.flops == pytest.approx(four.body.flops, rel=0.01)
    assert eight.body.bytes == pytest.approx(four.body.bytes, rel=0.05)
    assert eight.outside.flops == pytest.approx(four.outside.flops, rel=0.01)
    # outside the loop XLA prefetches the small [L, ...] stacks (norm weights) to VMEM:
    # four more layers add there well under a hundredth of one layer's body
    assert abs(eight.outside.seconds - four.outside.seconds) < 0.01 * eight.body.seconds
    body4, body8 = 4 * four.body.seconds, 8 * eight.body.seconds
    assert body8 == pytest.approx(2 * body4, rel=0.05)
    assert eight.call_s - eight.outside.seconds == pytest.approx(body8)


def test_pallas_calls_are_costed_from_cost_py(aot_dirs, monkeypatch):
    _, _, [base] = compiled.read_aot(aot_dirs[4])
    p = compiled.program_of(json.loads((aot_dirs[4] / "summary.json").read_text()), 64)
    F, D = MOE["moe_intermediate_size"], MOE["hidden_size"]
    down = cost.moe_matmul(tokens=64, top_k=4, experts=64, k=F, n=D, glu=False,
                           lhs_itemsize=2, w_itemsize=2, out_itemsize=2)
    assert base.kernels[cost.TPU_MOE_DOWN].flops == round(down.flops / p.ep)
    assert base.body.by_class["experts"] > 0 and base.body.by_class["attention"] > 0
    # a kernel that cost.py prices 1000x higher must make the layer 1000x its experts' time
    real = cost.estimate
    monkeypatch.setattr(cost, "estimate", lambda name, **kw: cost.KernelCost(
        *(1000 * v for v in dataclasses.astuple(real(name, **kw)))))
    _, _, [scaled] = compiled.read_aot(aot_dirs[4])
    assert scaled.body.by_class["experts"] == pytest.approx(
        1000 * base.body.by_class["experts"], rel=1e-3)


def test_cli_prints_the_table_and_the_analytic_comparison(aot_dirs, capsys):
    assert roofline_main(["--aot", str(aot_dirs[4]), "--eff-compute", "0.5"]) == 0
    text = capsys.readouterr().out
    assert "TPU v6e" in text and "ASSUMED" in text and "compute 0.5" in text
    assert "every sequence at 4096 keys after the step (max_model_len" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("64 |"))
    assert len(row.split("|")) == 6  # rows | outside | layer | call | analytic, ratio | XLA
    assert "analytic ms" in text
    assert "within 10%" in text or "compiled / analytic =" in text


def test_the_assumed_context_is_an_input_stated_in_the_table(aot_dirs, capsys):
    """The attention kernels do work for the real contexts, which no static reading sees:
    --context-len sets the keys per sequence that cost.py's attention estimate and the
    analytic model assume, and the table says which."""
    summary = json.loads((aot_dirs[4] / "summary.json").read_text())
    _, _, [full] = compiled.read_aot(aot_dirs[4])
    _, _, [short] = compiled.read_aot(aot_dirs[4], context_len=256)
    p = compiled.program_of(summary, 64, context_len=256)
    assert short.kernels[cost.TPU_ATTENTION] == compiled.kernel_cost(cost.TPU_ATTENTION, p)
    assert short.kernels[cost.TPU_ATTENTION] != full.kernels[cost.TPU_ATTENTION]
    assert short.body.by_class["attention"] < full.body.by_class["attention"]
    assert short.analytic_by_class["attention"] < full.analytic_by_class["attention"]
    assert short.body.by_class["experts"] == full.body.by_class["experts"]
    assert roofline_main(["--aot", str(aot_dirs[4]), "--context-len", "256"]) == 0
    assert "every sequence at 256 keys after the step," in capsys.readouterr().out
    with pytest.raises(ValueError, match="outside 1..max_model_len"):
        compiled.read_aot(aot_dirs[4], context_len=4097)
