"""MuxWise's decode TBT measured from simulated token times, oracle against the engine's
estimator, sync against async launches, with and without step-time noise (issue #30
finding 5): two fixed scenarios on Qwen3-30B-A3B, 2x H100 TP2.

- heavy: 96 requests decoding 4k contexts (60 tokens each) while two 16k prompts prefill,
  TBT SLO 40 ms (tests/test_sim_muxwise.py's estimator test);
- tight: 32 requests decoding 2k contexts (100 tokens each) beside two 16k prompts,
  TBT SLO 30 ms.

Per variant: the largest gap, the share of gaps over the SLO, the mean error of the
predicted decode / prefill finish, and the longer prompts' mean TTFT.

    .venv/bin/python launch/diag_muxwise_tbt.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lp_jax.roofline import QWEN3_30B_A3B, get_hardware  # noqa: E402
from lp_jax.sim import MuxWiseOptions, Request, SimConfig, Simulator  # noqa: E402

SCENARIOS = {
    "heavy": (0.04, [Request(0.001 * i, 4096, 60) for i in range(96)]
              + [Request(1.0 + 0.3 * i, 16000, 4) for i in range(2)]),
    "tight": (0.03, [Request(0.001 * i, 2048, 100) for i in range(32)]
              + [Request(0.3 + 0.4 * i, 16000, 4) for i in range(2)]),
}
VARIANTS = {
    "oracle, sync": {},
    "oracle, sync, noise 5%": dict(noise=0.05),
    "estimator, sync": dict(predictor="estimator"),
    "estimator, sync, noise 5%": dict(predictor="estimator", noise=0.05),
    "estimator, async, noise 5%": dict(predictor="estimator", noise=0.05, launches="async"),
    "oracle, async, noise 5%": dict(noise=0.05, launches="async"),
}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.parse_args(argv)
    rows = []
    print("| scenario | variant | max gap ms | gaps over the SLO | decode / prefill "
          "prediction error | long-prompt TTFT s |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, (tbt, reqs) in SCENARIOS.items():
        for label, opts in VARIANTS.items():
            cfg = SimConfig(shape=QWEN3_30B_A3B, hardware=get_hardware("h100"), tp=2,
                            policy="muxwise", tbt_slo_s=tbt, muxwise=MuxWiseOptions(**opts))
            res = Simulator(cfg).run(reqs)
            gaps = [g for m in res.metrics for g in m.itls]
            long_ttft = [m.ttft for r, m in zip(reqs, res.metrics, strict=True)
                         if r.prompt_len > 8192]
            row = {"scenario": name, "variant": label, "tbt_slo_s": tbt,
                   "max_gap_s": max(gaps), "over": sum(g > tbt for g in gaps) / len(gaps),
                   "decode_err": res.extra["muxwise_decode_pred_error"],
                   "prefill_err": res.extra["muxwise_prefill_pred_error"],
                   "long_ttft_s": sum(long_ttft) / len(long_ttft)}
            rows.append(row)
            print(f"| {name} ({1e3 * tbt:.0f} ms) | {label} | {1e3 * row['max_gap_s']:.1f} | "
                  f"{100 * row['over']:.1f}% | {100 * row['decode_err']:.1f}% / "
                  f"{100 * row['prefill_err']:.1f}% | {row['long_ttft_s']:.3f} |")
    return rows


if __name__ == "__main__":
    main()
