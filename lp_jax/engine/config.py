"""Engine arguments: one frozen dataclass, validated once, vLLM-named where it can be."""

from __future__ import annotations

import dataclasses
import os

from lp_jax.config import resolve_kv_cache_dtype
from lp_jax.core.config import SchedulerConfig
from lp_jax.core.policies import Policy, resolve_policy
from lp_jax.quant import REQUESTABLE
from lp_jax.spec.config import SpeculativeConfig

DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "lp_jax", "jax_cache")
DEFAULT_MAX_MODEL_LEN = 8192  # the default context cap (the checkpoint's, if shorter)


def default_max_model_len(max_position_embeddings: int) -> int:
    return min(max_position_embeddings, DEFAULT_MAX_MODEL_LEN)


def default_prefill_budget(policy_budget: int, max_model_len: int) -> int:
    """The engine's default max_num_batched_tokens: the policy's (orca: max_model_len,
    chunked: 512, layered and FlowPrefill: the paper's 8192), capped at the model's
    context. A model of short context gets programs no longer than one of its prompts
    instead of 8,192-row ones (the embedded 512-token model: 8 programs, not 16); a real
    checkpoint's default context (8,192 tokens) keeps the policy's budget."""
    return min(policy_budget, max_model_len)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    model: str | None = None  # Hugging Face directory; None: the embedded fable model
    # "orca", "chunked", "layered", "flowprefill", a Policy subclass, or the dotted path
    # of one ("package.module:Class"); lp_jax/core/policies/base.py is the interface.
    scheduling: str | type[Policy] = "layered"
    max_model_len: int | None = None  # None: min(max_position_embeddings, 8192)
    max_num_seqs: int = 32
    # None: the policy's default, capped at max_model_len (default_prefill_budget)
    max_num_batched_tokens: int | None = None
    layer_groups: str | int = "paper"  # "paper", "pow2", "adaptive" or a fixed group count
    # "adaptive": each iteration's span keeps the predicted step within tbt_slo_ms x
    # (1 - adaptive_margin) (or the tightest running request's TBT SLO); None: no limit.
    tbt_slo_ms: float | None = None
    adaptive_margin: float = 0.1
    max_layer_groups: int = 16
    # FlowPrefill (flowprefill.py): where a prefill may be paused ("operator", "layer" or
    # "group"); `preemptible` makes a layered batch preemptible at its group boundaries.
    preemption_granularity: str = "operator"
    preemptible: bool = False
    slo_alpha: float = 0.1  # SLO-aware batching's margin: alpha * the TTFT SLO
    # "reference": the released FlowPrefill code's rules; "lp_jax": this project's earlier
    # ones (SchedulerConfig, lp_jax/core/policies/flowprefill.py).
    flowprefill_rules: str = "reference"
    # Paused batches whose hidden states stay on device, each in max_num_batched_tokens
    # rows of the hidden buffer (Qwen3-30B-A3B at 8192 tokens: 32 MiB each).
    max_paused_prefills: int = 8
    # FlowPrefill segments dispatched ahead, k: a plan carries up to k of the running
    # batch's segments as one call (one host plan, dispatch and commit), at most k + 1
    # outstanding; an urgent arrival waits for up to k + 1 segments (flowprefill.py).
    flowprefill_lookahead: int = 1
    slo_classes: dict | str | None = None  # {name: {"ttft_ms", "tbt_ms"}}, JSON, or a path
    latency_model: str | None = None  # a fitted estimator (python -m lp_jax.engine.profile_latency)
    prefill_only: bool = False  # every request ends at its first token (disaggregated prefill)
    page_size: int = 16
    # Share the KV pages of equal prompt prefixes between requests (block_manager.py), on
    # by default as in vLLM v1.
    enable_prefix_caching: bool = True
    kv_pages: int | None = None  # logical pages (per layer); None: from kv_memory_fraction
    kv_memory_fraction: float = 0.5  # of free accelerator memory, when kv_pages is None
    load_format: str = "auto"  # "auto", "safetensors", "dummy", "orbax"
    mesh_shape: tuple | dict | None = None  # (expert, tensor) or (data, expert, tensor)
    dtype: str | None = None  # None: the checkpoint's dtype
    # Weight format (lp_jax/quant): None serves the checkpoint's (16-bit, or the FP8 its
    # config.json declares); "int8" / "fp8" quantise a 16-bit checkpoint per channel at load;
    # "mxfp4" keeps GPT-OSS's MXFP4 experts in 4 bits (else dequantised to 16 at load).
    quantization: str | None = None
    # The KV pool's format, vLLM's values: "auto" (the model's dtype) or "fp8" / "fp8_e4m3"
    # (float8_e4m3fn pages with the checkpoint's per-layer k_scale / v_scale, else 1.0;
    # half the bytes per page, so twice the default pages; lp_jax/models/kv_cache.py).
    kv_cache_dtype: str = "auto"
    moe_backend: str = "auto"
    # Expert-parallel MoE (mesh "expert" axis > 1): "allreduce" (every expert shard routes
    # every token, partial outputs summed), "all_to_all" (rows sent to their expert's
    # shard and back), "auto" (the fewer communication bytes per layer; sharded_kernels).
    moe_dispatch: str = "auto"
    attention_backend: str = "auto"
    # Start-up self-test of the selected Pallas kernels (kernel_check.py): "fallback" serves
    # a failing op with its safe backend, "strict" raises, "off" skips the test.
    backends: str = "fallback"
    seed: int = 0
    # Row counts the step is compiled for, one program each; None: step.default_token_buckets.
    token_buckets: tuple[int, ...] | None = None
    warmup: bool = True  # compile every program at start-up
    # Plan and dispatch the next step while a decode-only step runs (llm_engine.py).
    async_scheduling: bool = True
    # JAX's persistent compilation cache; None: none of lp_jax's own. A cache JAX already
    # has (JAX_COMPILATION_CACHE_DIR, or an earlier engine in the process) is kept.
    compilation_cache_dir: str | None = DEFAULT_CACHE_DIR
    # Several processes, one SPMD engine (distributed.py): all None reads LP_NUM_PROCESSES /
    # LP_PROCESS_ID / LP_COORDINATOR_ADDRESS, else a TPU pod or SLURM job JAX detects,
    # else one process. Process 0 leads; see plan_channel.py.
    num_processes: int | None = None
    process_id: int | None = None
    coordinator_address: str | None = None
    plan_channel: str = "host"  # "host" (TCP) or "device" (broadcast_one_to_all)
    follower_timeout_s: float = 60.0  # a follower silent this long ends the leader
    # The decision trace (lp_jax/trace/writer.py): one JSON line per plan and request
    # event, written here; `python -m lp_jax.trace plot` draws it.
    trace_path: str | None = None
    # Scheduler time advanced by the latency estimator's predicted step times instead of
    # wall time (core/clock.py): arrivals, deadlines and metrics on it, reproducible.
    virtual_clock: bool = False
    # Speculative decoding, vLLM's dict (or its JSON): {"method": "ngram",
    # "num_speculative_tokens": k, "prompt_lookup_min": n, "prompt_lookup_max": m};
    # None: off. lp_jax/spec/config.py checks it; docs/speculative.md describes it.
    speculative_config: dict | str | SpeculativeConfig | None = None

    def __post_init__(self):
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.parse(self.speculative_config))
        if self.backends not in ("fallback", "strict", "off"):
            raise ValueError(f"backends must be fallback, strict or off, got {self.backends!r}")
        resolve_policy(self.scheduling)  # raises ValueError naming what is wrong
        for name in ("max_num_seqs", "max_layer_groups", "page_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("max_model_len", "max_num_batched_tokens", "kv_pages"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got "
                             f"{self.enable_prefix_caching!r}")
        if self.moe_dispatch not in ("allreduce", "all_to_all", "auto"):
            raise ValueError("moe_dispatch must be allreduce, all_to_all or auto, got "
                             f"{self.moe_dispatch!r}")
        if self.quantization is not None and self.quantization not in REQUESTABLE:
            raise ValueError(f"quantization must be None or one of {list(REQUESTABLE)}, got "
                             f"{self.quantization!r} (a quantized checkpoint is detected "
                             "from its config.json)")
        resolve_kv_cache_dtype(self.kv_cache_dtype)  # raises ValueError naming the values
        if self.plan_channel not in ("host", "device"):
            raise ValueError(f"plan_channel must be host or device, got {self.plan_channel!r}")
        if not self.follower_timeout_s > 0:
            raise ValueError(f"follower_timeout_s must be > 0, got {self.follower_timeout_s}")
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if self.token_buckets is not None:
            v = tuple(sorted(set(int(b) for b in self.token_buckets)))
            if not v or v[0] < 1:
                raise ValueError(f"token_buckets must be positive sizes, got {self.token_buckets}")
            object.__setattr__(self, "token_buckets", v)

    def scheduler_config(self, model_config, *, max_model_len: int,
                         num_pages: int) -> SchedulerConfig:
        """The scheduler's config, derived: every field both configs name is taken as
        is; the rest come from the model. A budget left to the policy is capped at
        max_model_len (default_prefill_budget). Raises ValueError for a bad combination."""
        mine = {f.name for f in dataclasses.fields(self)}
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(SchedulerConfig)
                  if f.name in mine}
        cfg = SchedulerConfig(**(shared | dict(
            policy=resolve_policy(self.scheduling),
            tbt_slo_s=None if self.tbt_slo_ms is None else self.tbt_slo_ms / 1e3,
            num_layers=model_config.num_hidden_layers, vocab_size=model_config.vocab_size,
            eos_token_id=model_config.eos_token_id,
            extra_eos_token_ids=model_config.extra_eos_token_ids,
            max_model_len=max_model_len, num_pages=num_pages)))
        if self.max_num_batched_tokens is None:
            cfg = dataclasses.replace(cfg, max_num_batched_tokens=default_prefill_budget(
                cfg.max_num_batched_tokens, max_model_len))
        return cfg

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Like the constructor, but names the unknown argument instead of a TypeError."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise TypeError(f"unknown engine arguments {unknown}; valid: {sorted(fields)}")
        return cls(**kwargs)
