"""The engine's time: the wall clock, or a virtual one advanced by predicted step times.

Every time the engine gives the scheduler (plan times, arrivals stamped by `add_request`,
SLO deadlines, token and finish times, hence every request metric) comes from one clock
object. `WallClock` reads `time.perf_counter()`. `VirtualClock` (`EngineConfig.virtual_clock`)
moves only when a step completes, by what the scheduler's latency estimator predicted for
it, so the schedule of a run is a function of its requests and step count, not of a noisy
host; the numerics (the tokens) are computed as usual.

The virtual device runs steps back to back in dispatch order: a step dispatched at virtual
time t starts at max(t, the previous step's end) and ends `predicted` seconds later; its
collection moves the clock to its end. With overlapped scheduling the next plan is made
while the previous step runs, at the time that step was dispatched, as on the real host.

An estimator that learns from wall-clock steps would bring the noise back, so under a
virtual clock the engine does not feed it measurements: it predicts with the model it
loaded (`latency_model`), or with `nominal_latency`, a fixed model of a few milliseconds
per step (it knows nothing of the hardware; only the order of events is meant to be real).
"""

from __future__ import annotations

import time

from lp_jax.core.latency import FEATURES, LatencyModel, ModelDims

# Seconds per unit of each latency feature (latency.py): a step costs ~1 ms plus ~2-4 us
# per prompt token per operator unit and ~20 us per decode row per layer.
_NOMINAL = {"attn_tt": 1e-9, "attn_tp": 1e-9, "attn_t": 2e-6, "mlp_t": 4e-6,
            "experts": 1e-5, "decode_rows": 2e-5, "decode_context": 1e-8, "units": 1e-5,
            "calls": 1e-4, "step": 1e-3}


def nominal_latency(dims: ModelDims) -> LatencyModel:
    """A fixed latency model for a virtual clock when none was fitted."""
    return LatencyModel(dims, coef=[_NOMINAL[f] for f in FEATURES],
                        source="nominal (virtual clock)")


class WallClock:
    """Host time (perf_counter); steps are timed by the executor."""

    virtual = False

    def now(self) -> float:
        return time.perf_counter()

    def dispatched(self, step_id: int, predicted_s: float) -> None:
        pass

    def collected(self, step_id: int) -> tuple[float, float] | None:
        """None: the caller times the step from its measurements."""
        return None


class VirtualClock:
    """Time that moves by predicted step times (module note)."""

    virtual = True

    def __init__(self, start: float = 0.0) -> None:
        self.t = float(start)
        self._device_free = self.t  # when the last dispatched step ends
        self._runs: dict[int, tuple[float, float]] = {}  # step id -> (start, end)

    def now(self) -> float:
        return self.t

    def advance_to(self, t: float) -> None:
        """Moves the clock forward to t (an idle engine waiting for an arrival)."""
        self.t = max(self.t, float(t))

    def dispatched(self, step_id: int, predicted_s: float) -> None:
        start = max(self.t, self._device_free)
        self._device_free = start + max(predicted_s, 0.0)
        self._runs[step_id] = (start, self._device_free)

    def collected(self, step_id: int) -> tuple[float, float]:
        """The step's (start, end); the clock moves to its end."""
        start, end = self._runs.pop(step_id)
        self.t = max(self.t, end)
        return start, end
