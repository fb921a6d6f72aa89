"""`python -m lp_jax.trace plot TRACE.jsonl --out timeline.png`: draws a decision trace as
a Gantt chart (timeline.py); `python -m lp_jax.trace summary TRACE.jsonl` prints its event
counts and the latency estimator's error against the measured steps."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from lp_jax.trace.timeline import plot_timeline, summary
from lp_jax.trace.writer import load


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lp_jax.trace", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    plot = sub.add_parser("plot", help="draw the timeline (PNG)")
    plot.add_argument("trace")
    plot.add_argument("--out", default="timeline.png")
    plot.add_argument("--title", default=None)
    plot.add_argument("--max-rows", type=int, default=200, help="requests drawn, first ones")
    summ = sub.add_parser("summary", help="event counts and the estimator's error")
    summ.add_argument("trace")
    args = p.parse_args(argv)
    if args.command == "plot":
        rows = plot_timeline(args.trace, args.out, title=args.title, max_rows=args.max_rows)
        print(f"wrote {args.out}: {len(rows)} requests")
    else:
        print(json.dumps(summary(load(args.trace)), indent=1))


if __name__ == "__main__":
    main()
