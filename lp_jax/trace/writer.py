"""The decision trace: one JSON line per event of a serving run, engine or simulator.

Lines, each a JSON object with "event" and "t" (the run's clock, seconds: perf_counter
time in the engine, the virtual or simulated clock otherwise):

    header   once, first: "source" (engine / sim), "policy", "num_layers", "clock"
    arrival  "seq", "prompt_tokens", "max_tokens", "slo" ({ttft_s, tbt_s, name} or null)
    plan     one per executed plan, written when it completes: "step", "phase", "decode"
             (seq ids), "prefill" ([{seq, start, end, samples}]: token range of each chunk),
             "batch_id", "unit_start" / "unit_end" (operator units: 2i is layer i's
             attention half, 2i + 1 its MLP half), "group_index" / "num_groups", "t" (when
             planned), "start" / "end" (when it ran), "predicted_s" (the scheduler's latency
             estimator) and "measured_s" (the executor's time; null where not measured)
    pause    a preemptible prefill batch set aside: "batch_id", "seqs"
    resume   a paused batch running again: "batch_id", "seqs"
    preempt  a recompute preemption (KV dropped): "seq"
    finish   "seq", "reason" (stop / length / abort), "output_tokens"

Idle plans write no line. Pauses, resumes and preemptions are read from the scheduler's
counters around each plan (`prefill_pauses`, `prefill_resumes`, `preemptions`), so
policies need no hook: a pause sets aside the batch the previous plan ran, a resume runs
the batch of this one. Plan lines come when a step completes, so with overlapped
scheduling the file is in completion order; `load` sorts nothing, readers use "t".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO


class TraceWriter:
    """Writes the trace to a path (created, truncated) or an open text file."""

    def __init__(self, out: str | Path | IO[str], **header) -> None:
        if isinstance(out, (str, Path)):
            self._file, self._owned = open(out, "w", buffering=1), True  # noqa: SIM115
        else:
            self._file, self._owned = out, False
        self._pending: dict[int, dict] = {}  # step id -> its plan line, until it completes
        self._live: dict[int, tuple[object, int]] = {}  # seq id -> (seq, preemptions seen)
        self._counts: tuple[object, dict] | None = None  # (scheduler, its counters)
        self._last_batch: tuple[int, list[int]] | None = None  # of the last prefill plan
        self._write({"event": "header", "t": 0.0, **header})

    def _write(self, d: dict) -> None:
        self._file.write(json.dumps(d) + "\n")

    def arrival(self, seq, t: float) -> None:
        slo = seq.slo
        self._live[seq.seq_id] = (seq, seq.num_preemptions)
        self._write({"event": "arrival", "t": t, "seq": seq.seq_id,
                     "prompt_tokens": seq.num_prompt_tokens,
                     "max_tokens": seq.sampling_params.max_tokens,
                     "slo": None if slo is None else {"ttft_s": slo.ttft_s, "tbt_s": slo.tbt_s,
                                                      "name": slo.name}})

    def plan(self, plan, t: float, predicted: float | None, sched=None) -> None:
        """A plan just made at t; `sched`: the scheduler that made it (its counters name
        the pauses, resumes and preemptions the plan caused)."""
        batch = ((plan.prefill_batch_id, [c.seq.seq_id for c in plan.prefill])
                 if plan.prefill else None)
        if sched is not None:
            self._events(sched, batch, t)
        if plan.prefill:
            self._last_batch = batch
        if plan.phase == "idle":
            return
        self._pending[plan.step_id] = {
            "event": "plan", "t": t, "step": plan.step_id, "phase": plan.phase,
            "decode": [s.seq_id for s in plan.decode],
            "prefill": [{"seq": c.seq.seq_id, "start": c.start, "end": c.end,
                         "samples": c.samples} for c in plan.prefill],
            "batch_id": plan.prefill_batch_id, "unit_start": plan.unit_start,
            "unit_end": plan.unit_end, "group_index": plan.group_index,
            "num_groups": plan.num_groups, "predicted_s": predicted}

    def _events(self, sched, batch, t: float) -> None:
        now = sched.stats()
        keys = ("prefill_pauses", "prefill_resumes", "preemptions")
        counts = {k: now.get(k, 0) for k in keys}
        if self._counts is None or self._counts[0] is not sched:  # a new scheduler
            self._counts = (sched, counts)
            return
        before = self._counts[1]
        self._counts = (sched, counts)
        last = self._last_batch
        if counts["prefill_pauses"] > before["prefill_pauses"] and last is not None and (
                batch is None or batch[0] != last[0]):
            self._write({"event": "pause", "t": t, "batch_id": last[0], "seqs": last[1]})
        if counts["prefill_resumes"] > before["prefill_resumes"] and batch is not None:
            self._write({"event": "resume", "t": t, "batch_id": batch[0], "seqs": batch[1]})
        if counts["preemptions"] > before["preemptions"]:
            for sid, (seq, seen) in list(self._live.items()):
                if seq.num_preemptions > seen:
                    self._live[sid] = (seq, seq.num_preemptions)
                    self._write({"event": "preempt", "t": t, "seq": sid})

    def step_done(self, plan, measured: float | None, start: float, end: float) -> None:
        """The plan's step ran from start to end; `measured`: the executor's seconds."""
        line = self._pending.pop(plan.step_id, None)
        if line is not None:
            line.update(start=start, end=end, measured_s=measured)
            self._write(line)

    def finish(self, seq, t: float) -> None:
        self._live.pop(seq.seq_id, None)
        self._write({"event": "finish", "t": t, "seq": seq.seq_id,
                     "reason": seq.finish_reason, "output_tokens": seq.num_output_tokens})

    def close(self) -> None:
        if self._owned and not self._file.closed:
            self._file.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load(path: str | Path) -> list[dict]:
    """A trace's lines, as written."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
