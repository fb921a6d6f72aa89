"""lp-bench results: the metric maths, and JSON, PNG and TensorBoard outputs.

Per request, measured at the client: TTFT = first token event - send time; ITLs = gaps
between consecutive token events; max ITL = the largest; E2E = last token event - send
time; TPOT = (E2E - TTFT) / (events - 1). A request meets the SLOs when it succeeded, its
TTFT <= ttft_slo and its max ITL <= itl_slo (`lp_jax.core.metrics.slo_pass`; a failed
request fails them). Over a run of `duration` seconds (start to the last response):

- slo_attainment = requests meeting the SLOs / all requests
- goodput = requests meeting the SLOs / duration (requests per second)
- request_throughput = successful requests / duration
- output_throughput = completion tokens of successful requests / duration
- total_token_throughput = (prompt + completion tokens of successful requests) / duration
- percentiles (p50, p90, p99, numpy's linear method) of TTFT, max ITL and E2E per request
  (`lp_jax.core.metrics.summarize`), of all ITLs pooled, and of TPOT.

Multi-SLO runs (requests with a class) also get `per_class`: per class, the request counts,
TTFT attainment against the class's own objective (share of its requests, failed ones
included, whose TTFT <= ttft_slo_ms), TTFT p50 / p99, and TBT attainment (max ITL <=
tbt_slo_ms) where the class sets one; `class_ttft_attainment` and `class_slo_attainment`
(every objective of its class met) over all requests, and `class_slo_goodput` (requests
meeting theirs per second). Fields of a class that are guesses, not the paper's, are listed
under `assumed` and printed as ASSUMED.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from lp_jax.core.metrics import RequestMetrics, percentile, slo_pass, summarize

PCTS = (50, 90, 99)


def request_metrics(rec) -> RequestMetrics:
    """Client-side RequestMetrics: arrival = send time; failed requests have no tokens."""
    times = tuple(rec.token_times) if rec.ok else ()
    return RequestMetrics(rec.send_time, token_times=times)


def _met(rec, m: RequestMetrics, kind: str) -> bool | None:
    """Whether a request met its own `kind` objective (ttft or tbt); None: it sets none."""
    target = rec.ttft_slo_ms if kind == "ttft" else rec.tbt_slo_ms
    if target is None:
        return None
    value = m.ttft if kind == "ttft" else (m.max_itl if m.num_tokens else None)
    return value is not None and value * 1e3 <= target


def _class_summary(recs, assumed: tuple[str, ...]) -> dict:
    ms = [request_metrics(r) for r in recs]
    ttfts = [m.ttft for m in ms if m.ttft is not None]
    out = {"num_requests": float(len(recs)), "num_failed": float(sum(not r.ok for r in recs)),
           "prompt_len_mean": sum(r.prompt_len for r in recs) / len(recs),
           "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99)}
    for kind in ("ttft", "tbt"):
        met = [x for x in (_met(r, m, kind) for r, m in zip(recs, ms, strict=True))
               if x is not None]
        if met:  # a class's requests share its objectives
            out[f"{kind}_slo_ms"] = getattr(recs[0], f"{kind}_slo_ms")
            out[f"num_{kind}_attained"] = float(sum(met))
            out[f"{kind}_attainment"] = sum(met) / len(met)
    if assumed:
        out["assumed"] = list(assumed)
    return out


def summarize_classes(records, duration: float,
                      assumed: dict[str, tuple[str, ...]] | None = None) -> dict:
    """The multi-SLO part of a run's summary (see the module docstring); {} when no request
    has a class. `assumed`: class name -> the fields that are guesses."""
    by_class: dict[str, list] = {}
    for r in records:
        if r.slo_class is not None:
            by_class.setdefault(r.slo_class, []).append(r)
    if not by_class:
        return {}
    assumed = assumed or {}
    recs = [r for rs in by_class.values() for r in rs]
    ms = [request_metrics(r) for r in recs]
    ttft_met = [x for x in (_met(r, m, "ttft") for r, m in zip(recs, ms, strict=True))
                if x is not None]
    all_met = [all(x is not False for x in (_met(r, m, "ttft"), _met(r, m, "tbt"))) and r.ok
               for r, m in zip(recs, ms, strict=True)]
    return {
        "per_class": {name: _class_summary(rs, tuple(assumed.get(name, ())))
                      for name, rs in sorted(by_class.items())},
        "class_ttft_attainment": sum(ttft_met) / len(ttft_met) if ttft_met else math.nan,
        "class_slo_attainment": sum(all_met) / len(recs),
        "class_slo_goodput": sum(all_met) / duration if duration > 0 else math.nan,
    }


def summarize_run(records, duration: float, ttft_slo: float, itl_slo: float,
                  assumed: dict[str, tuple[str, ...]] | None = None) -> dict:
    ms = [request_metrics(r) for r in records]
    out = summarize(ms, ttft_slo, itl_slo)
    ok = [r for r in records if r.ok]
    passed = sum(slo_pass(m, ttft_slo, itl_slo) for m in ms)
    itls = [x for m in ms for x in m.itls]
    tpots = [(m.e2e - m.ttft) / (m.num_tokens - 1) for m in ms if m.num_tokens > 1]
    out.update(
        num_failed=float(len(records) - len(ok)),
        duration=duration,
        ttft_slo=ttft_slo,
        itl_slo=itl_slo,
        num_slo_passed=float(passed),
        goodput=passed / duration if duration > 0 else math.nan,
        request_throughput=len(ok) / duration if duration > 0 else math.nan,
        output_throughput=(sum(r.completion_tokens for r in ok) / duration
                           if duration > 0 else math.nan),
        total_token_throughput=(sum(r.completion_tokens + (r.prompt_tokens or r.prompt_len)
                                    for r in ok) / duration if duration > 0 else math.nan),
        itl_mean=sum(itls) / len(itls) if itls else math.nan,
        tpot_mean=sum(tpots) / len(tpots) if tpots else math.nan,
        max_send_lag=max((r.send_time - r.scheduled for r in records), default=0.0),
    )
    for q in PCTS:
        out[f"itl_p{q}"] = percentile(itls, q)
        out[f"tpot_p{q}"] = percentile(tpots, q)
    if "slo_attainment" not in out:
        out["slo_attainment"] = math.nan
    out.update(summarize_classes(records, duration, assumed))
    return out


def _clean(x):
    """JSON without NaN: NaN and infinities become null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


def write_results(out, results: dict, render) -> str:
    """A launch benchmark's outputs: `out`/results.json and `out`/results.md (the
    markdown `render(results)` makes, also printed); returns the markdown."""
    from pathlib import Path

    out = Path(out)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    md = render(results)
    (out / "results.md").write_text(md)
    print(md)
    return md


def write_json(path, results: dict) -> None:
    Path(path).write_text(json.dumps(_clean(results), indent=1))


def format_summary(s: dict) -> str:
    def ms(key):
        v = s.get(key)
        return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v*1e3:.1f}"

    lines = [
        f"requests {int(s['num_requests'])} (failed {int(s['num_failed'])}) in "
        f"{s['duration']:.2f} s: {s['request_throughput']:.2f} req/s, "
        f"{s['output_throughput']:.1f} output tok/s, {s['total_token_throughput']:.1f} tok/s",
        f"SLO (TTFT <= {s['ttft_slo']:g} s, max ITL <= {s['itl_slo']:g} s): attainment "
        f"{s['slo_attainment']:.3f}, goodput {s['goodput']:.2f} req/s",
        f"TTFT ms   p50 {ms('ttft_p50')}  p90 {ms('ttft_p90')}  p99 {ms('ttft_p99')}",
        f"ITL ms    p50 {ms('itl_p50')}  p90 {ms('itl_p90')}  p99 {ms('itl_p99')}",
        f"maxITL ms p50 {ms('max_itl_p50')}  p90 {ms('max_itl_p90')}  p99 {ms('max_itl_p99')}",
        f"E2E ms    p50 {ms('e2e_p50')}  p90 {ms('e2e_p90')}  p99 {ms('e2e_p99')}",
    ]
    if s.get("per_class"):
        lines += _format_classes(s)
    return "\n".join(lines)


def _format_classes(s: dict) -> list[str]:
    def ms(v):
        return "n/a" if v is None or math.isnan(v) else f"{v * 1e3:.1f}"

    lines = [f"per-class SLOs: TTFT attainment {s['class_ttft_attainment']:.3f}, all "
             f"objectives {s['class_slo_attainment']:.3f}, goodput "
             f"{s['class_slo_goodput']:.2f} req/s"]
    width = max(len(name) for name in s["per_class"])
    for name, c in s["per_class"].items():
        line = f"  {name:<{width}}  n {int(c['num_requests'])} (failed {int(c['num_failed'])})"
        if "ttft_attainment" in c:
            line += f"  TTFT <= {c['ttft_slo_ms']:g} ms: {c['ttft_attainment']:.3f}"
        line += f"  TTFT p50 {ms(c['ttft_p50'])}  p99 {ms(c['ttft_p99'])} ms"
        if "tbt_attainment" in c:
            line += f"  maxITL <= {c['tbt_slo_ms']:g} ms: {c['tbt_attainment']:.3f}"
        if c.get("assumed"):
            line += f"  [ASSUMED: {', '.join(c['assumed'])}]"
        lines.append(line)
    return lines


def _cdf(ax, xs, label):
    xs = sorted(xs)
    if xs:
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)


def write_plot(path, runs: list[dict]) -> None:
    """A 2x3 summary figure: latency CDFs, E2E vs prompt, throughput, SLO vs rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    (a_ttft, a_itl, a_max), (a_e2e, a_tput, a_slo) = axes
    for run in runs:
        recs = [r for r in run["records"] if r.ok]
        label = f"rate {run['request_rate']:g}"
        ms = [request_metrics(r) for r in recs]
        _cdf(a_ttft, [m.ttft for m in ms], label)
        _cdf(a_itl, [x for m in ms for x in m.itls], label)
        _cdf(a_max, [m.max_itl for m in ms], label)
        a_e2e.scatter([r.prompt_len for r in recs], [m.e2e for m in ms], s=6, label=label)
        times = sorted(t for r in recs for t in r.token_times)
        if times:
            width = max(run["summary"]["duration"] / 60, 0.01)  # about 60 bins
            nbins = max(1, math.ceil(times[-1] / width))
            counts = [0] * nbins
            for t in times:
                counts[min(int(t / width), nbins - 1)] += 1
            a_tput.plot([(i + 0.5) * width for i in range(nbins)],
                        [c / width for c in counts], label=label)
    s0 = runs[0]["summary"] if runs else {}
    for ax, title, slo in ((a_ttft, "TTFT", s0.get("ttft_slo")),
                           (a_itl, "inter-token latency", s0.get("itl_slo")),
                           (a_max, "max ITL per request", s0.get("itl_slo"))):
        ax.set(title=f"{title} CDF", xlabel="seconds", ylabel="fraction of requests")
        if slo:
            ax.axvline(slo, color="k", ls="--", lw=0.8, label="SLO")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    a_itl.set_ylabel("fraction of ITLs")
    a_e2e.set(title="E2E latency vs prompt length", xlabel="prompt tokens", ylabel="seconds")
    a_tput.set(title="output tokens per second", xlabel="seconds since start", ylabel="tok/s")
    # An infinite offered rate is drawn at the achieved request throughput.
    rates = [r["request_rate"] if math.isfinite(r["request_rate"])
             else r["summary"]["request_throughput"] for r in runs]
    a_slo.plot(rates, [r["summary"]["slo_attainment"] for r in runs], "o-", label="attainment")
    a_slo.set(title="SLO attainment and goodput vs rate", xlabel="request rate (req/s)",
              ylabel="SLO attainment", ylim=(0, 1.05))
    a2 = a_slo.twinx()
    a2.plot(rates, [r["summary"]["goodput"] for r in runs], "s--", color="C1", label="goodput")
    a2.set_ylabel("goodput (req/s)")
    for ax in (a_ttft, a_itl, a_max, a_e2e, a_tput):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    a_slo.legend(loc="lower left", fontsize=7)
    a2.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class ScalarWriter:
    """TensorBoard scalars through tensorboard's own event writer (no TensorFlow)."""

    def __init__(self, logdir):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        Path(logdir).mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(logdir))

    def scalar(self, tag: str, value: float, step: int) -> None:
        if value is None or not math.isfinite(value):
            return
        summary = self._summary_pb2.Summary(
            value=[self._summary_pb2.Summary.Value(tag=tag, simple_value=float(value))])
        self._writer.add_event(self._event_pb2.Event(wall_time=time.time(), step=int(step),
                                                     summary=summary))

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


def write_tensorboard(logdir, runs: list[dict]) -> None:
    """summary/* per run (step = run index, rate in summary/request_rate); request/* and
    throughput/* per request and per second of each run, under run<i>/."""
    w = ScalarWriter(logdir)
    try:
        for i, run in enumerate(runs):
            s = run["summary"]
            w.scalar("summary/request_rate", run["request_rate"], i)
            for key, v in s.items():
                if isinstance(v, int | float):
                    w.scalar(f"summary/{key}", v, i)
            for name, c in s.get("per_class", {}).items():
                for key, v in c.items():
                    if isinstance(v, int | float):
                        w.scalar(f"class/{name}/{key}", v, i)
            for rec in run["records"]:
                m = request_metrics(rec)
                if m.ttft is not None:
                    w.scalar(f"run{i}/request/ttft", m.ttft, rec.index)
                    w.scalar(f"run{i}/request/max_itl", m.max_itl, rec.index)
                    w.scalar(f"run{i}/request/e2e", m.e2e, rec.index)
            times = sorted(t for r in run["records"] if r.ok for t in r.token_times)
            if times:
                counts: dict[int, int] = {}
                for t in times:
                    counts[int(t)] = counts.get(int(t), 0) + 1
                for sec in range(int(times[-1]) + 1):
                    w.scalar(f"run{i}/throughput/output_tokens_per_s", counts.get(sec, 0), sec)
    finally:
        w.close()
