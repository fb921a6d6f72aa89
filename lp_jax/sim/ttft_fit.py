"""FlowPrefill's TTFT predictor (a cubic in prompt tokens fitted to a profiled table) against
the engine's LatencyModel, on one simulated profile, scored on held-out prefills.

Design note. The released FlowPrefill predicts a prefill's time from a profiled table of
(prompt tokens, seconds) with a cubic fit (issue #30 finding 2); lp_jax predicts it with
`LatencyModel` (lp_jax/core/latency.py: linear in ten plan features, among them sum T^2,
T x cached context and the experts a step activates). Both are fitted here to the same
profile, simulated (the executor's calibrated cost is the measurement; `noise` multiplies
each by exp(noise x z)), not measured on hardware:
- "single" (FlowPrefill's table): one prompt at each of `PROFILE_TOKENS`, whole stack,
  alone on the device;
- "mixed" (what lp_jax's profile_latency also sees): those, plus as many batches of 2-4
  prompts and prompts after a cached prefix, drawn apart from the held-out ones (the cubic
  fits them by their total new tokens).
Held-out sets, scored
against the noise-free simulated time (absolute relative error):
- "single": lone prompts at random lengths inside the profiled range;
- "batch": 2-8 prompts batched in one step (FlowPrefill's SLO-aware batching predicts a
  batch by its total tokens);
- "cached": a prompt after a cached prefix (prefix cache or an earlier chunk): the cubic
  sees only the new tokens;
- "longer": lone prompts up to twice the longest profiled one (extrapolation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lp_jax.core.latency import LatencyModel, ModelDims
from lp_jax.core.plan import PrefillChunk, StepPlan
from lp_jax.core.sampling_params import SamplingParams
from lp_jax.core.sequence import Sequence
from lp_jax.sim.executor import CostModelExecutor

PROFILE_TOKENS = tuple(int(round(64 * 2 ** (i / 2))) for i in range(17))  # 64 ... 16384
HELD_OUT = ("single", "batch", "cached", "longer")


@dataclass(frozen=True, slots=True)
class CubicTTFT:
    """seconds = c0 + c1 n + c2 n^2 + c3 n^3 in the step's prompt tokens n (least squares
    on relative error, as the LatencyModel is fitted, or plain as `numpy.polyfit`)."""

    coef: tuple[float, float, float, float]

    @classmethod
    def fit(cls, tokens, seconds, relative: bool = True) -> CubicTTFT:
        n = np.asarray(tokens, dtype=np.float64)
        y = np.asarray(seconds, dtype=np.float64)
        if n.size < 4:
            raise ValueError(f"a cubic needs >= 4 profiled points, got {n.size}")
        scale = n.max()
        X = np.stack([(n / scale) ** k for k in range(4)], axis=1)
        w = 1.0 / y if relative else np.ones_like(y)
        c, *_ = np.linalg.lstsq(X * w[:, None], y * w, rcond=None)
        return cls(tuple(float(c[k] / scale**k) for k in range(4)))

    def predict(self, tokens: float) -> float:
        return sum(c * tokens**k for k, c in enumerate(self.coef))


def _plan(num_layers: int, prompts: list[tuple[int, int]]) -> StepPlan:
    """One prefill step of [(new tokens, cached context before them)], whole stack."""
    chunks = []
    for i, (t, p) in enumerate(prompts):
        seq = Sequence(i, [1] * (p + t), SamplingParams(max_tokens=1))
        chunks.append(PrefillChunk(seq, p, p + t))
    return StepPlan(0, num_layers, prefill=tuple(chunks), prefill_batch_id=0)


def held_out(kind: str, rng: np.random.Generator, n: int = 40) -> list[list[tuple[int, int]]]:
    lo, hi = PROFILE_TOKENS[0], PROFILE_TOKENS[-1]
    if kind == "single":
        return [[(int(t), 0)] for t in np.exp(rng.uniform(math.log(lo), math.log(hi), n))]
    if kind == "longer":
        return [[(int(t), 0)] for t in rng.uniform(hi, 2 * hi, n)]
    if kind == "batch":
        out = []
        for _ in range(n):
            k = int(rng.integers(2, 9))
            out.append([(int(t), 0) for t in rng.integers(64, 2048, k)])
        return out
    if kind == "cached":
        return [[(int(rng.integers(256, 4096)), int(rng.integers(1024, 12288)))]
                for _ in range(n)]
    raise ValueError(f"held-out set must be one of {HELD_OUT}, got {kind!r}")


def compare(executor: CostModelExecutor, *, noise: float = 0.0, seed: int = 0,
            profile_kind: str = "single") -> dict:
    """Fit both predictors to one profile; their errors on each held-out set."""
    if profile_kind not in ("single", "mixed"):
        raise ValueError(f'profile_kind must be "single" or "mixed", got {profile_kind!r}')
    rng = np.random.default_rng(seed)
    L = executor.shape.num_layers
    expert_size = executor.shape.expert_bytes or 1
    latency = LatencyModel(ModelDims.from_config(executor.shape))
    points = [[(t, 0)] for t in PROFILE_TOKENS]
    if profile_kind == "mixed":
        extra = np.random.default_rng(seed + 1)
        for _ in range(len(PROFILE_TOKENS)):
            points.append([(int(t), 0) for t in extra.integers(64, 2048, extra.integers(2, 5))])
            points.append([(int(extra.integers(256, 4096)), int(extra.integers(1024, 12288)))])
    profile = []
    for prompts in points:
        plan = _plan(L, prompts)
        t = sum(n for n, _ in prompts)
        cost = executor.run(plan)
        y = cost.seconds * (math.exp(noise * rng.standard_normal()) if noise else 1.0)
        experts = cost.expert_bytes / expert_size if executor.shape.is_moe else None
        x = latency.plan_features(plan)
        if experts is not None:
            x[4] = experts
        profile.append((t, x, y))
    latency.fit([(x, y) for _, x, y in profile], "simulated profile")
    cubic = CubicTTFT.fit([t for t, _, _ in profile], [y for _, _, y in profile])
    cubic_plain = CubicTTFT.fit([t for t, _, _ in profile], [y for _, _, y in profile],
                                relative=False)
    out: dict = {"profile": profile_kind, "profile_points": len(profile), "noise": noise}
    for kind in HELD_OUT:
        errs = {"latency_model": [], "cubic": [], "cubic_plain": []}
        for prompts in held_out(kind, rng):
            plan = _plan(L, prompts)
            truth = executor.run(plan).seconds
            tokens = sum(t for t, _ in prompts)
            errs["latency_model"].append(abs(latency.predict_plan(plan) - truth) / truth)
            errs["cubic"].append(abs(cubic.predict(tokens) - truth) / truth)
            errs["cubic_plain"].append(abs(cubic_plain.predict(tokens) - truth) / truth)
        out[kind] = {k: {"mean": float(np.mean(v)), "max": float(np.max(v))}
                     for k, v in errs.items()}
    return out
