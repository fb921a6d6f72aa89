"""Step-latency estimator: what a scheduler believes a plan will take, fitted to the
executor it drives.

One model serves every policy that must predict time: FlowPrefill's slack (remaining
prefill time, flowprefill.py) and the SLO-adaptive layered policy. It is linear in ten
features of a plan, each a count the executor's work grows with:

    attention units with prefill rows x  sum T^2, sum T * P, sum T  (T: chunk tokens,
                                                                    P: context before it)
    MLP units with prefill rows       x  sum T
    experts activated                    (expert weights read; measured when the executor
                                          reports it, else the expected count for uniform
                                          top-k routing, corrected by the measured ratio)
    decode rows x layers, decode context x layers
    operator units executed, calls (dispatched programs), 1 per step

The experts term is what lets it tell a 512-token chunk from a whole prompt: each chunk
reloads the experts. The linear part is the *solo* cost (prefill-only and decode-only
steps); a step that runs prefill rows beside decode rows is that times a **contention
guard** factor per (decode batch, prefill tokens) cell (`ContentionGuard`), learnt from
mixed steps as measured / solo prediction. Coefficients are non-negative least squares on
relative error (steps span orders of magnitude), from sufficient statistics with
exponential forgetting,
so the model refreshes online from every measured step (`observe`) at O(features^2) per
step and re-solves only when asked to predict after new data. `save` / `load` keep a
fitted model; `python -m lp_jax.engine.profile_latency --out FILE [engine args]` profiles the
engine on a grid of prompt and decode sizes and writes one. Pure Python (ten features
need no numpy), so the scheduler core stays importable without numpy or jax.

The simulator's `Calibration` (lp_jax/sim/calibration.py) is the other side of the same
coin: it turns roofline seconds into the simulated hardware's step time (the ground truth
there), while this model is the scheduler's belief, fitted from observed steps in the
engine and in the simulator alike. Local axis letters: F = features.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

FEATURES = ("attn_tt", "attn_tp", "attn_t", "mlp_t", "experts", "decode_rows",
            "decode_context", "units", "calls", "step")
_F = len(FEATURES)
_RIDGE = 1e-6  # relative to the mean diagonal of the normalised Gram matrix


@dataclass(frozen=True, slots=True)
class ModelDims:
    """What the features need to know about the model."""

    num_layers: int
    num_experts: int = 0  # 0: dense
    top_k: int = 0
    moe_layers: tuple[bool, ...] | None = None  # per layer; None: all MoE when num_experts

    def is_moe(self, layer: int) -> bool:
        if not self.num_experts:
            return False
        return True if self.moe_layers is None else self.moe_layers[layer]

    def expected_experts(self, rows: float) -> float:
        """Distinct experts `rows` tokens activate in one MoE layer, routing uniform."""
        if not self.num_experts or rows <= 0:
            return 0.0
        e, k = self.num_experts, self.top_k
        return e * (1.0 - (1.0 - k / e) ** rows)

    @classmethod
    def from_config(cls, cfg) -> ModelDims:
        """From the engine's ModelConfig or the simulator's ModelShape."""
        L = getattr(cfg, "num_hidden_layers", None) or cfg.num_layers
        E = getattr(cfg, "num_experts", 0) or 0
        k = getattr(cfg, "num_experts_per_tok", None) or getattr(cfg, "top_k", 0) or 0
        moe = tuple(bool(cfg.is_moe_layer(i)) for i in range(L)) if E else None
        return cls(L, E, k if E else 0, moe)


def _units(a: int, b: int) -> tuple[int, int]:
    """(attention units, MLP units) in [a, b): even units are attention halves."""
    attn = (b + 1) // 2 - (a + 1) // 2
    return attn, (b - a) - attn


def _bucket(n: int) -> int:
    return int(n).bit_length()  # 0, 1, 2-3, 4-7, ...


class ContentionGuard:
    """Slowdown of prefill rows run beside a decode batch, against the sum of their solo
    costs: a factor per (decode rows, prefill tokens) cell in powers of two, an
    exponential moving average of measured / solo-predicted over mixed steps. An unseen
    cell borrows the mean of its decode row's cells, else of all cells, else 1."""

    def __init__(self, cells: dict | None = None, decay: float = 0.8):
        self.cells: dict[tuple[int, int], float] = dict(cells or {})
        self.decay = decay

    def factor(self, num_decode: int, tokens: int) -> float:
        if not num_decode or not tokens or not self.cells:
            return 1.0
        b, t = _bucket(num_decode), _bucket(tokens)
        if (b, t) in self.cells:
            return self.cells[b, t]
        row = [f for (bb, _), f in self.cells.items() if bb == b] or list(self.cells.values())
        return sum(row) / len(row)

    def update(self, num_decode: int, tokens: int, ratio: float) -> None:
        ratio = min(max(ratio, 0.25), 4.0)  # one outlier step must not swing it
        key = (_bucket(num_decode), _bucket(tokens))
        old = self.cells.get(key)
        self.cells[key] = ratio if old is None else self.decay * old + (1 - self.decay) * ratio


class LatencyModel:
    _SOLO_STEPS = 8  # solo steps of each kind before mixed steps only train the guard

    def __init__(self, dims: ModelDims, coef=None, *, forgetting: float = 0.995,
                 source: str = "unfitted (learns online)"):
        if not 0 < forgetting <= 1:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        self.dims = dims
        self.forgetting = forgetting
        self.source = source
        self.coef_F = [0.0] * _F if coef is None else [float(c) for c in coef]
        if len(self.coef_F) != _F:
            raise ValueError(f"need {_F} coefficients, got {len(self.coef_F)}")
        self._gram_FF = [[0.0] * _F for _ in range(_F)]
        self._rhs_F = [0.0] * _F
        self._stale = False
        self._expert_ratio = 1.0  # measured / expected activated experts (routing skew)
        self.num_observed = 0
        self._abs_rel_err = 0.0  # mean |predicted - measured| / measured, online
        self._abs_rel_err_ema = 0.0
        self.guard = ContentionGuard()
        self._since_solve = 0
        self._solo_steps = {"prefill": 0, "decode": 0}
        self._moe_prefix = [0]
        for i in range(dims.num_layers):
            self._moe_prefix.append(self._moe_prefix[-1] + dims.is_moe(i))

    # --------------------------------------------------------------- features
    def features(self, chunks_TP: Sequence[tuple[int, int]], a: int, b: int,
                 num_decode: int = 0, decode_context: int = 0, *, segments: int = 1,
                 experts: float | None = None) -> list[float]:
        """Features of running prefill chunks [(tokens, context before)] through units
        [a, b) in `segments` plans, each next to `num_decode` decodes over all layers.
        a == b: no prefill (a decode-only step when num_decode > 0)."""
        L, d = self.dims.num_layers, self.dims
        x = [0.0] * _F
        T = sum(t for t, _ in chunks_TP)
        n_attn, n_mlp = _units(a, b) if T else (0, 0)
        if T:
            x[0] = n_attn * sum(t * t for t, _ in chunks_TP)
            x[1] = n_attn * sum(t * p for t, p in chunks_TP)
            x[2] = n_attn * T
            x[3] = n_mlp * T
        B = num_decode
        if experts is None:  # MoE MLP units in [a, b) see T + B rows, the rest B rows
            # layer i's MLP half is unit 2i + 1: a <= 2i + 1 < b for i in [a // 2, b // 2)
            moe_mixed = self._moe_prefix[b // 2] - self._moe_prefix[a // 2] if T else 0
            moe_all = int(self._moe_prefix[-1])
            experts = moe_mixed * d.expected_experts(T + B)
            experts += segments * ((moe_all - moe_mixed) if B else 0) * d.expected_experts(B)
            if B and T and segments > 1:  # decodes alone through the span's MoE layers
                experts += (segments - 1) * moe_mixed * d.expected_experts(B)
            experts *= self._expert_ratio
        x[4] = experts
        x[5] = segments * L * B
        x[6] = segments * L * decode_context
        x[7] = segments * 2 * L if B else (b - a)
        calls = 1 + (B > 0 and T > 0 and a > 0) + (B > 0 and T > 0 and b < 2 * L)
        x[8] = segments * calls
        x[9] = segments
        return x

    def plan_features(self, plan, experts: float | None = None) -> list[float]:
        chunks = [(c.num_tokens, c.start) for c in plan.prefill]
        a, b = (plan.unit_start, plan.unit_end) if chunks else (0, 0)
        # a speculating decode is its k + 1 verification rows, each over its context
        drafts = plan.drafts or ((),) * len(plan.decode)
        ctx = sum(s.num_tokens * (1 + len(d)) for s, d in zip(plan.decode, drafts, strict=True))
        return self.features(chunks, a, b, plan.num_decode_rows, ctx, experts=experts)

    # --------------------------------------------------------------- predict
    def predict(self, x_F: list[float], num_decode: int = 0, tokens: int = 0) -> float:
        """Seconds for features x_F; with decodes and prefill tokens both present, the
        solo cost times the contention guard's factor."""
        if self._stale:
            self._solve()
        solo = sum(c * x for c, x in zip(self.coef_F, x_F, strict=True))
        return solo * self.guard.factor(num_decode, tokens)

    def predict_plan(self, plan) -> float:
        return self.predict(self.plan_features(plan), plan.num_decode_rows,
                            plan.num_prefill_tokens)

    def peek_plan(self, plan) -> float:
        """predict_plan for an observer (the decision trace): the same value, without
        re-solving the fit in place, so that observing changes nothing the scheduler
        sees later (observe() uses the coefficients as they stand)."""
        if not self._stale:
            return self.predict_plan(plan)
        coef, since = self.coef_F, self._since_solve
        try:
            return self.predict_plan(plan)
        finally:
            self.coef_F, self._since_solve, self._stale = coef, since, True

    def prefill_seconds(self, chunks_TP, a: int, b: int, *, segments: int = 1,
                        num_decode: int = 0, decode_context: int = 0) -> float:
        """Predicted time to run chunks through units [a, b) in `segments` steps."""
        if a >= b:
            return 0.0
        return self.predict(self.features(chunks_TP, a, b, num_decode, decode_context,
                                          segments=segments),
                            num_decode, sum(t for t, _ in chunks_TP))

    # --------------------------------------------------------------- learn
    def observe(self, plan, seconds: float, experts: float | None = None) -> None:
        """One measured step. `experts`: activated experts the executor counted."""
        if not (math.isfinite(seconds) and seconds > 0):
            return
        x_F = self.plan_features(plan)
        if experts is not None:  # the measured count replaces the expected one
            expected = x_F[4] / self._expert_ratio
            if expected > 0 and experts > 0:
                self._expert_ratio = 0.9 * self._expert_ratio + 0.1 * experts / expected
            x_F[4] = experts
        B, T = plan.num_decode_rows, plan.num_prefill_tokens
        # With the coefficients as they are: re-solved every 32 new steps, not per step.
        if self._stale and self._since_solve >= 32:
            self._solve()
        solo = sum(c * x for c, x in zip(self.coef_F, x_F, strict=True))
        if self.num_observed:
            err = abs(solo * self.guard.factor(B, T) - seconds) / seconds
            n = self.num_observed
            self._abs_rel_err += (err - self._abs_rel_err) / n
            self._abs_rel_err_ema = 0.95 * self._abs_rel_err_ema + 0.05 * err
        self.num_observed += 1
        if B and T and min(self._solo_steps.values()) >= self._SOLO_STEPS:
            if solo > 0:  # a mixed step trains the guard, not the solo costs
                self.guard.update(B, T, seconds / solo)
            return
        if not (B and T):
            self._solo_steps["decode" if B else "prefill"] += 1
        self._add([(x_F, seconds)])
        self._since_solve += 1

    def fit(self, samples: Iterable[tuple[list[float], float]], source: str = "fitted"):
        """Replace what was learnt with a fit to (features, seconds) samples."""
        self._gram_FF = [[0.0] * _F for _ in range(_F)]
        self._rhs_F = [0.0] * _F
        n = self._add(samples, forget=False)
        self._solve()
        self.source = f"{source} on {n} steps"
        return self

    def _add(self, samples, forget: bool = True) -> int:
        n = 0
        g, h, lam = self._gram_FF, self._rhs_F, self.forgetting if forget else 1.0
        for x_F, y in samples:
            w2 = 1.0 / (y * y)  # relative error: each step weighs the same
            for i in range(_F):
                wx = w2 * x_F[i]
                row = g[i]
                for j in range(_F):
                    row[j] = lam * row[j] + wx * x_F[j]
                h[i] = lam * h[i] + wx * y
            n += 1
        self._stale = self._stale or n > 0
        return n

    def _solve(self) -> None:
        self._stale = False
        self._since_solve = 0
        used = [i for i in range(_F) if self._gram_FF[i][i] > 0]
        if not used:
            return
        s = [math.sqrt(self._gram_FF[i][i]) for i in used]
        g = [[self._gram_FF[i][j] / (s[a] * s[b]) for b, j in enumerate(used)]
             for a, i in enumerate(used)]
        ridge = _RIDGE * max(sum(g[a][a] for a in range(len(used))) / len(used), 1e-30)
        for a in range(len(used)):
            g[a][a] += ridge
        x = nnls_gram(g, [self._rhs_F[i] / s[a] for a, i in enumerate(used)])
        coef = [0.0] * _F
        for a, i in enumerate(used):
            coef[i] = x[a] / s[a]
        self.coef_F = coef

    # --------------------------------------------------------------- report
    def error(self) -> dict:
        """Predicted against measured, over the steps observed since start."""
        return {"steps": self.num_observed, "mean_abs_rel_error": self._abs_rel_err,
                "recent_abs_rel_error": self._abs_rel_err_ema, "source": self.source,
                "contention_cells": len(self.guard.cells)}

    def to_dict(self) -> dict:
        d = self.dims
        if self._stale:
            self._solve()
        return {"features": list(FEATURES), "coef": list(self.coef_F),
                "gram": [list(r) for r in self._gram_FF], "rhs": list(self._rhs_F),
                "expert_ratio": self._expert_ratio, "source": self.source,
                "guard": [[b, t, f] for (b, t), f in sorted(self.guard.cells.items())],
                "solo_steps": dict(self._solo_steps),
                "dims": {"num_layers": d.num_layers, "num_experts": d.num_experts,
                         "top_k": d.top_k,
                         "moe_layers": None if d.moe_layers is None else list(d.moe_layers)}}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path, dims: ModelDims | None = None, **kwargs) -> LatencyModel:
        """A saved model; `dims` (the model being served) must match the file's."""
        try:
            data = json.loads(Path(path).read_text())
            saved = data["dims"]
            file_dims = ModelDims(saved["num_layers"], saved["num_experts"], saved["top_k"],
                                  None if saved["moe_layers"] is None
                                  else tuple(saved["moe_layers"]))
            if data["features"] != list(FEATURES):
                raise ValueError(f"features {data['features']} are not {list(FEATURES)}")
            coef = [float(c) for c in data["coef"]]
            gram = [[float(v) for v in row] for row in data["gram"]]
            rhs = [float(v) for v in data["rhs"]]
            if len(coef) != _F or len(rhs) != _F or [len(r) for r in gram] != [_F] * _F:
                raise ValueError("coefficient arrays have the wrong shapes")
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read latency model {str(path)!r}: {e}") from None
        if dims is not None and dims != file_dims:
            raise ValueError(f"latency model {str(path)!r} was fitted for {file_dims}, "
                             f"not this model ({dims})")
        model = cls(file_dims, coef, source=f"{data.get('source', 'file')} ({path})", **kwargs)
        model._gram_FF, model._rhs_F = gram, rhs
        model._expert_ratio = float(data.get("expert_ratio", 1.0))
        model.guard = ContentionGuard({(int(b), int(t)): float(f)
                                       for b, t, f in data.get("guard", [])})
        model._solo_steps.update(data.get("solo_steps", {}))
        return model


def nnls_gram(g: list[list[float]], h: list[float], tol: float = 1e-12) -> list[float]:
    """argmin_{x >= 0} x'Gx/2 - h'x for a symmetric positive definite G (Lawson-Hanson
    active set on the normal equations)."""
    n = len(h)
    x = [0.0] * n
    passive = [False] * n
    thresh = tol * max(1.0, max(abs(v) for v in h))
    for _ in range(3 * n):
        w = [h[i] - sum(g[i][j] * x[j] for j in range(n)) for i in range(n)]  # -gradient
        cand = [i for i in range(n) if not passive[i] and w[i] > thresh]
        if not cand:
            break
        passive[max(cand, key=lambda i: w[i])] = True
        while True:
            idx = [i for i in range(n) if passive[i]]
            sol = _solve([[g[i][j] for j in idx] for i in idx], [h[i] for i in idx])
            z = [0.0] * n
            for k, i in enumerate(idx):
                z[i] = sol[k]
            if all(z[i] > 0 for i in idx):
                x = z
                break
            alpha = min(x[i] / (x[i] - z[i]) for i in idx if z[i] <= 0)
            x = [xi + alpha * (zi - xi) for xi, zi in zip(x, z, strict=True)]
            passive = [p and xi > tol for p, xi in zip(passive, x, strict=True)]
            if not any(passive):
                break
    return x


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """a x = b by Gaussian elimination with partial pivoting (a is small and SPD)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        piv = m[c][c] or 1e-300
        for r in range(c + 1, n):
            f = m[r][c] / piv
            if f:
                for k in range(c, n + 1):
                    m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / (m[r][r] or 1e-300)
    return x


# --------------------------------------------------------------------- profiling
def profile_prompts(budget: int, max_model_len: int, max_num_seqs: int, rng) -> list[list]:
    """Prompt length waves for profiling: each wave is a list of prompt lengths that
    arrive together (a prefill batch, then its decodes)."""
    waves = []
    top = max(2, min(budget, max_model_len - 8))
    sizes = sorted({max(1, int(top * f)) for f in (0.02, 0.05, 0.12, 0.25, 0.5, 0.9)})
    for n in sizes:
        waves.append([n])
        k = max(1, min(max_num_seqs, top // max(n, 1)))
        waves.append([max(1, int(x)) for x in rng.integers(max(1, n // 2), n + 1, size=k)])
    return waves
