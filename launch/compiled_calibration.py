"""Write the simulator's compiled calibration of an AOT run (issue #26 §4).

Reads the optimized HLO of every program of `python -m lp_jax.aot ... --out DIR` through
the compiled-program roofline (`python -m lp_jax.roofline --aot DIR`), and writes the
per-term factors (compiled / analytic seconds at each row bucket; lp_jax/sim/compiled_cost.py)
to a JSON file that `launch/reproduce_paper.py --cost compiled --calibration MODEL=FILE` and
`SimConfig(compiled_cost=CompiledCalibration.load(FILE))` read. Prints the factors.

    .venv/bin/python launch/compiled_calibration.py --aot /tmp/aot_q3 --out runs/cal/qwen_v6e.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lp_jax.sim.compiled_cost import describe, from_aot  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--aot", type=Path, required=True, help="a python -m lp_jax.aot --out DIR")
    ap.add_argument("--out", type=Path, required=True, help="the calibration JSON to write")
    ap.add_argument("--eff-compute", type=float, default=None,
                    help="share of peak FLOP/s (default: the roofline's, assumed)")
    ap.add_argument("--eff-mem", type=float, default=None,
                    help="share of HBM bandwidth (default: the roofline's, assumed)")
    args = ap.parse_args()
    cal = from_aot(args.aot, eff_compute=args.eff_compute, eff_mem=args.eff_mem)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cal.write(args.out)
    print(describe(cal))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
