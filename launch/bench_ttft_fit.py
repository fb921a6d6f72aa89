"""FlowPrefill's cubic-in-tokens TTFT predictor against the engine's LatencyModel, fitted
to the same simulated profile and scored on held-out prefills (lp_jax/sim/ttft_fit.py).

Models: Qwen3-30B-A3B on 2x H100 TP2 and Llama3-8B on one A800 (FlowPrefill's), each with
the GPU prior calibration; profiles "single" (FlowPrefill's table of lone prompts) and
"mixed" (plus batches and cached prefixes); profile noise 0 and 5%. Mean / max absolute
relative error per held-out set; the cubic is fitted on relative error ("cubic") and
plainly ("cubic plain", numpy.polyfit's least squares).

    .venv/bin/python launch/bench_ttft_fit.py --out runs/ttft_fit
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lp_jax.roofline import get_hardware  # noqa: E402
from lp_jax.roofline.model_shape import resolve_model  # noqa: E402
from lp_jax.sim import CostModelExecutor, prior_calibration  # noqa: E402
from lp_jax.sim.ttft_fit import HELD_OUT, compare  # noqa: E402

SETUPS = (("Qwen3-30B-A3B", "h100", 2), ("Llama3-8B", "A800 SXM 80GB", 1))
PREDICTORS = ("latency_model", "cubic", "cubic_plain")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/ttft_fit")
    ap.add_argument("--noise", default="0,0.05")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rows, results = [], []
    for name, hw, tp in SETUPS:
        h = get_hardware(hw)
        ex = CostModelExecutor(resolve_model(name), h, tp=tp,
                               calibration=prior_calibration(h.name))
        for noise in (float(x) for x in args.noise.split(",")):
            for kind in ("single", "mixed"):
                r = compare(ex, noise=noise, seed=args.seed, profile_kind=kind)
                r["model"], r["hardware"], r["tp"] = name, h.name, tp
                results.append(r)
                for held in HELD_OUT:
                    cells = [f"{100 * r[held][p]['mean']:.1f} / {100 * r[held][p]['max']:.0f}"
                             for p in PREDICTORS]
                    best = min(PREDICTORS, key=lambda p: r[held][p]["mean"])
                    rows.append(f"| {name} | {kind} | {noise:g} | {held} | "
                                + " | ".join(cells) + f" | {best} |")
    md = "\n".join([
        "| model | profile | noise | held-out | LatencyModel % mean / max | cubic | "
        "cubic plain | lowest mean |", "| --- | --- | ---: | --- | ---: | ---: | ---: | --- |",
        *rows, ""])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ttft_fit.md").write_text(md)
    (out / "ttft_fit.json").write_text(json.dumps(results, indent=1))
    print(md)
    return {"results": results}


if __name__ == "__main__":
    main()
