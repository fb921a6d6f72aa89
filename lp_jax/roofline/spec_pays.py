"""When speculative decoding pays on a MoE: the roofline of a verification step.

Design note. A decode step of B sequences runs B rows; a speculating one runs B (k + 1)
verification rows (each sequence's last token and its k drafts) and emits, per sequence,
the accepted drafts plus one token. With a per-token acceptance rate alpha (draft j
stands with probability alpha once the drafts before it stood) a step emits

    tau(alpha, k) = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)

tokens per sequence, so the speedup per generated token is

    S(alpha, k, B) = tau(alpha, k) * T_decode(B) / (T_verify(B, k) + T_draft(B, k)).

On a dense model the k + 1 rows reuse the weights one decode row loads, so T_verify is
close to T_decode until the step turns compute-bound. On a MoE each verified row routes to
its own top-k experts: B (k + 1) rows touch E_act(B (k + 1)) distinct experts (routing.py),
more expert bytes than B rows do, until every expert is loaded anyway. Both steps are
costed by `cost_model.model_step_cost` (per device, a tp x ep layout): the verification
step is a prefill of B sequences with k + 1 tokens each after `context - 1` cached ones
(flash attention reads each sequence's KV once for its k + 1 rows), with logits on every
row; the decode step is B single-token rows at the same context.

The draft's cost per draft step (k chained steps):
- "ngram": none on the device (a host-side lookup);
- "eagle3": one dense decoder layer of the target's attention shape and a SwiGLU of
  `EAGLE3_MLP_RATIO` x D (ASSUMED: the published heads are Llama layers of that order),
  its q/k/v projection reading 2 x D (the embedding beside the hidden state), the fc
  over three hidden states (3D x D), and a `EAGLE3_DRAFT_VOCAB`-token lm_head;
- "mtp": one of the target's MoE layers for B rows, the eh_proj (2D x D) and the
  target's lm_head (DeepSeek-V3's next-token layer, reused for every draft step).

Not modelled: fixed per-step costs (kernel launches, host work), which only make
speculation pay more; correlation between the rows of one sequence (consecutive tokens
share experts more than independent ones do), which lowers E_act and also favours
speculation; the prefill a layered-prefill step carries beside its decodes (it loads
experts the verification rows then reuse). The figures are therefore a conservative
bound for the speedup under uniform routing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from lp_jax.config import ModelConfig
from lp_jax.roofline.cost_model import (
    OpCost,
    StepTokens,
    layer_cost,
    lm_head_cost,
    model_step_cost,
)
from lp_jax.roofline.hardware import HARDWARE, Hardware
from lp_jax.roofline.model_shape import ModelShape
from lp_jax.roofline.routing import UNIFORM, Routing
from lp_jax.spec.auto import AutoK, expected_tokens
from lp_jax.spec.config import SpeculativeConfig

DRAFTS = ("ngram", "eagle3", "mtp")
EAGLE3_MLP_RATIO = 3.0  # ASSUMED draft SwiGLU width / D
EAGLE3_DRAFT_VOCAB = 32000  # the published EAGLE-3 heads' draft_vocab_size
DEFAULT_CONTEXT = 2048


def break_even_alpha(ratio: float, k: int) -> float:
    """The acceptance at which tau(alpha, k) equals `ratio` (the step's cost relative to a
    decode step): speculation with k drafts pays above it; 1.0 + eps (inf) when even a
    perfect draft does not pay (ratio > k + 1)."""
    if ratio <= 1.0:
        return 0.0
    if ratio > k + 1:
        return math.inf
    lo, hi = 0.0, 1.0
    for _ in range(60):  # tau rises monotonically in alpha
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if expected_tokens(mid, k) < ratio else (lo, mid)
    return hi


@dataclass(frozen=True, slots=True)
class SpecSetup:
    """One model on one chip in a tp x ep layout, decoding at `context` tokens of KV."""

    shape: ModelShape
    hardware: Hardware
    draft: str = "ngram"
    tp: int = 1
    ep: int = 1
    context: int = DEFAULT_CONTEXT
    routing: Routing = UNIFORM
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.draft not in DRAFTS:
            raise ValueError(f"draft must be one of {list(DRAFTS)}, got {self.draft!r}")
        if self.context < 1:
            raise ValueError(f"context must be >= 1, got {self.context}")

    def decode_seconds(self, batch: int) -> float:
        """T_decode(B): one token for each of B sequences."""
        return self._memoised(("decode", batch), lambda: self._time(model_step_cost(
            self.shape, StepTokens(decode_seqs=batch, decode_context=self.context),
            tp=self.tp, ep=self.ep, routing=self.routing)))

    def verify_seconds(self, batch: int, k: int) -> float:
        """T_verify(B, k): the target on B (k + 1) rows, logits on each."""
        if k == 0:
            return self.decode_seconds(batch)
        step = StepTokens(prefill_tokens=batch * (k + 1), prefill_seqs=batch,
                          prefill_past=self.context - 1)
        return self._memoised(("verify", batch, k), lambda: self._time(model_step_cost(
            self.shape, step, tp=self.tp, ep=self.ep, routing=self.routing,
            logits_tokens=batch * (k + 1))))

    def draft_seconds(self, batch: int, k: int) -> float:
        """T_draft(B, k): k chained draft steps of B rows (0 for n-gram)."""
        if self.draft == "ngram" or k == 0:
            return 0.0
        return k * self._memoised(("draft", batch), lambda: self._draft_step(batch))

    def step_ratio(self, batch: int, k: int) -> float:
        """(T_verify + T_draft) / T_decode: what a step with k drafts costs per decode step."""
        return (self.verify_seconds(batch, k) + self.draft_seconds(batch, k)) / (
            self.decode_seconds(batch))

    def speedup(self, alpha: float, batch: int, k: int) -> float:
        """S: tokens per second with k drafts over tokens per second without."""
        return expected_tokens(alpha, k) / self.step_ratio(batch, k)

    def best_k(self, alpha: float, batch: int, max_k: int) -> tuple[int, float]:
        """(k, S) maximising S over k in [0, max_k]; k = 0 (S = 1) when no k pays."""
        best = (0, 1.0)
        for k in range(1, max_k + 1):
            s = self.speedup(alpha, batch, k)
            if s > best[1]:
                best = (k, s)
        return best

    # ---- internals --------------------------------------------------------------------
    def _time(self, cost) -> float:
        return cost.time_on(self.hardware)

    def _memoised(self, key, compute):
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = compute()
        return hit

    def _draft_step(self, batch: int) -> float:
        s, d = self.shape, self.shape.hidden_size
        rows = StepTokens(decode_seqs=batch, decode_context=self.context)
        if self.draft == "mtp":
            moe = next((i for i in range(s.num_layers) if s.is_moe_layer(i)), 0)
            layer = layer_cost(s, rows, layer=moe, tp=self.tp, ep=self.ep, routing=self.routing)
            head = lm_head_cost(s, batch, tp=self.tp, ep=self.ep)
            extra = _dense_matmul(batch / self.ep, 2 * d, d / self.tp, s.dtype_bytes)
            return self._time(layer) + head.time_on(self.hardware) + extra.time_on(self.hardware)
        width = int(EAGLE3_MLP_RATIO * d)
        draft = replace(s, name=f"{s.name} EAGLE-3 head", num_layers=1, num_experts=0,
                        top_k=0, expert_width=0, dense_width=width, dense_layers=(),
                        sliding_layers=(), shared_width=0, mla_ranks=(),
                        vocab_size=EAGLE3_DRAFT_VOCAB, weight_format=None)
        layer = layer_cost(draft, rows, tp=self.tp, ep=self.ep)
        qkv = layer.op("qkv_proj")  # its input is 2 x D wide: twice the weights and FLOPs
        head = lm_head_cost(draft, batch, tp=self.tp, ep=self.ep)
        fc = _dense_matmul(batch / self.ep, 3 * d, d / self.tp, s.dtype_bytes)
        return (self._time(layer) + qkv.time_on(self.hardware) + head.time_on(self.hardware)
                + fc.time_on(self.hardware))


def _dense_matmul(rows: float, k: float, n: float, itemsize: float) -> OpCost:
    """A [rows, k] x [k, n] projection: its FLOPs, weights, input and output."""
    return OpCost(flops=2.0 * rows * k * n, bytes=itemsize * (k * n + rows * (k + n)),
                  name="draft_proj")


_DEVICE_KINDS = (  # substrings of jax's device_kind, lower-cased, to the table's entries
    ("h200", "H200 SXM"), ("h100", "H100 SXM"), ("b200", "B200"), ("a100", "A100 SXM 80GB"),
    ("v6", "TPU v6e"), ("v5 lite", "TPU v5e"), ("v5e", "TPU v5e"), ("v5", "TPU v5p"),
    ("v4", "TPU v4"), ("7x", "TPU7x (Ironwood)"),
)
FALLBACK_HARDWARE = "H200 SXM"


def hardware_for_device(device_kind: str) -> tuple[Hardware, bool]:
    """(the table entry for a jax device_kind, whether it was recognised). An unknown
    device (a CPU) gets FALLBACK_HARDWARE: the cost model needs some chip's balance."""
    kind = device_kind.lower()
    for needle, name in _DEVICE_KINDS:
        if needle in kind:
            return HARDWARE[name], True
    return HARDWARE[FALLBACK_HARDWARE], False


# speculative_config methods (vLLM's names) to the draft costs modelled above
_DRAFT_OF_METHOD = {"ngram": "ngram", "eagle3": "eagle3", "mtp": "mtp", "deepseek_mtp": "mtp"}


def auto_for_engine(spec_config: SpeculativeConfig | None, model_cfg: ModelConfig,
                    max_model_len: int, *, device_kind: str | None = None,
                    log: Callable[[str], object] = print) -> AutoK | None:
    """The engine's k chooser when `spec_config` asks for `"num_speculative_tokens": "auto"`
    (None otherwise): the served model (its weight and KV formats) on the chip jax reports
    (`device_kind`, default the first device's), one device, at a context of
    min(DEFAULT_CONTEXT, max_model_len) tokens, with the method's draft cost."""
    if spec_config is None or not spec_config.is_auto:
        return None
    if device_kind is None:
        import jax

        device_kind = jax.devices()[0].device_kind
    hardware, known = hardware_for_device(device_kind)
    shape = ModelShape.from_model_config(model_cfg, name=model_cfg.model_type)
    draft = _DRAFT_OF_METHOD.get(spec_config.method, "ngram")
    setup = SpecSetup(shape, hardware, draft=draft, context=min(DEFAULT_CONTEXT, max_model_len))
    max_k = spec_config.max_tokens
    log(f"speculative k auto: roofline of {shape.name} on {hardware.name}"
        + ("" if known else f" (device {device_kind!r} is not in the table)")
        + f", {draft} drafts, k in [0, {max_k}]")
    return AutoK(setup.step_ratio, max_k)


def max_batch(setup: SpecSetup, hbm_share: float = 0.9) -> int:
    """The most sequences of `setup.context` tokens whose KV fits beside the weights in
    `hbm_share` of the tp x ep chips' HBM (0 when the weights alone do not fit)."""
    s = setup.shape
    weights = (s.num_moe_layers * (s.expert_bytes_per_layer + s.shared_mlp_bytes)
               + s.num_layers * s.attention_weight_bytes
               + s.dense_layers_count * s.dense_mlp_bytes
               + s.vocab_size * s.hidden_size * s.dtype_bytes * (1 if s.tie_word_embeddings else 2))
    kv_token = s.num_layers * s.kv_values_per_token_layer * s.kv_itemsize
    free = hbm_share * setup.hardware.hbm_bytes * setup.tp * setup.ep - weights
    return max(0, int(free // (kv_token * setup.context)))
