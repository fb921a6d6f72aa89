"""DeepSeek-V3 (671B) in the simulator and the roofline: KV bytes a token against a GQA
model of the same size, and layered against chunked routed-expert bytes.

1. KV bytes a token (all layers, bf16): DeepSeek-V3's latent pool (kv_lora_rank +
   qk_rope_head_dim = 576 values a token a layer, what lp_jax's pool holds) against the
   same 61 layers with grouped-query attention (8 KV heads of 128, as Qwen3-235B and
   Llama-3-405B: 2 K H = 2,048 values) and against the per-head K and V that MLA expands
   to (128 heads, K 192 + V 128). Arithmetic on the config (lp_jax.sim.kv_bytes_per_token),
   not a measurement.
2. The paper's arXiv and ShareGPT workloads (launch/reproduce_paper.py) at one fixed
   Poisson rate, chunked prefill (512-token budget) against layered prefill (8192), on
   8x H200 with TP8, the weights in FP8 blocks (DeepSeek's published format: ~700 GB; bf16
   does not fit). Routed-expert bytes per 100 requests, mean TTFT and E2E. Cost model:
   the roofline with the GPU prior; Zipf routing fitted for Qwen3 and reused at E=256,
   k=8 (an assumption). Simulated, not measured: nothing ran on an H200.

    .venv/bin/python launch/sim_deepseek.py [--n 200] [--arxiv-rate 0.5] [--sharegpt-rate 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lp_jax.roofline import get_hardware  # noqa: E402
from lp_jax.roofline.model_shape import ModelShape  # noqa: E402
from lp_jax.sim import kv_bytes_per_token, prior_calibration  # noqa: E402

spec = importlib.util.spec_from_file_location("reproduce_paper", ROOT / "launch/reproduce_paper.py")
rp = importlib.util.module_from_spec(spec)
sys.modules["reproduce_paper"] = rp  # its dataclasses look it up
spec.loader.exec_module(rp)

V3 = ModelShape.from_json(ROOT / "checkpoints/configs/deepseek-v3.json", name="DeepSeek-V3")
MACHINE = rp.Machine("h200x8", "h200", tp=8)


def kv_table() -> str:
    gqa = dataclasses.replace(V3, mla_ranks=(), num_kv_heads=8, head_dim=128)
    per_head_bytes = V3.num_layers * 128 * (192 + 128) * 2
    rows = ["| cache | values a token a layer | KV bytes a token (61 layers, bf16) |",
            "| --- | ---: | ---: |"]
    for name, values, total in (
            ("DeepSeek-V3 latent (lp_jax's pool)", V3.kv_values_per_token_layer,
             kv_bytes_per_token(V3)),
            ("GQA, 8 KV heads x 128", gqa.kv_values_per_token_layer, kv_bytes_per_token(gqa)),
            ("MLA expanded per head (128 x (192 + 128))", 128 * (192 + 128), per_head_bytes)):
        rows.append(f"| {name} | {values:,} | {total:,.0f} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="requests a point")
    ap.add_argument("--arxiv-rate", type=float, default=0.5)
    ap.add_argument("--sharegpt-rate", type=float, default=2.0)
    args = ap.parse_args()
    t0 = time.time()
    print(kv_table())
    rp.MODELS["dsv3"] = V3.with_formats("fp8_block", None)
    cost = rp.Cost(MACHINE, prior_calibration(get_hardware(MACHINE.hardware).name))
    panels = (rp.Panel("dsv3-arxiv", "dsv3", "arxiv", 10.0, 0.100, (1.0, 1.0), False),
              rp.Panel("dsv3-sharegpt", "dsv3", "sharegpt", 5.0, 0.100, (3.0, 3.0), False))
    rates = {"dsv3-arxiv": args.arxiv_rate, "dsv3-sharegpt": args.sharegpt_rate}
    rows = ["| workload @ rate | policy | expert GB / 100 req | mean TTFT (s) | mean E2E (s) "
            "| SLO attainment |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for p in panels:
        got = {}
        for pol in rp.POLICIES:
            _, _, _, s = rp._reference((p, pol, "fixed", rates[p.key], args.n, cost))
            got[pol] = s
            rows.append(f"| {p.title} @ {rates[p.key]:g} req/s | {pol} | "
                        f"{s['expert_gb_per_100_requests']:,.0f} | {s['ttft_mean']:.2f} | "
                        f"{s['e2e_mean']:.1f} | {s['slo_attainment']:.0%} |")
        ch, la = (got[pol]["expert_gb_per_100_requests"] for pol in rp.POLICIES)
        rows.append(f"| {p.title} | layered vs chunked expert bytes | {la / ch - 1:+.1%} | | | |")
    print(f"DeepSeek-V3 (671B, FP8 blocks) on {MACHINE.title}, simulated; {args.n} requests "
          f"a point; {time.time() - t0:.0f} s")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
