"""Engine arguments: one frozen dataclass, validated once, vLLM-named where it can be."""

from __future__ import annotations

import dataclasses

from lp_jax.config import KV_CACHE_DTYPES, resolve_kv_cache_dtype
from lp_jax.core.config import SchedulerConfig
from lp_jax.core.policies import Policy, resolve_policy
from lp_jax.paths import CACHE_ENV, default_jax_cache_dir
from lp_jax.quant import REQUESTABLE
from lp_jax.sharding import parallel_mesh_shape
from lp_jax.spec.config import SpeculativeConfig

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


def engine_arg(default=dataclasses.MISSING, help: str | None = None, *, factory=None,
         **flag) -> dataclasses.Field:
    """A field whose `help` makes it a command-line flag (lp_jax/engine_args.py). `flag`
    holds the flag's other settings: `flags` (its spellings, default --the-field-name),
    `type` (a parser named in engine_args.PARSERS, default from the default's type),
    `choices`, `metavar`, `default_help` (the default, said in words)."""
    meta = {} if help is None else {"help": help, **flag}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """The engine's arguments. A field with help metadata is also a flag of every
    command that builds an engine (`lp serve`, and the subset `lp aot` compiles for):
    engine_args.py reads its name, type, default and help from here."""

    model: str | None = engine_arg(
        None, "Hugging Face model directory",
        default_help="the embedded fable model of checkpoints/train_demo.py")
    # A Policy subclass too, from Python; lp_jax/core/policies/base.py is the interface.
    scheduling: str | type[Policy] = engine_arg(
        "layered", "orca, chunked, layered, flowprefill (slack-aware EDF over the requests' "
        "TTFT deadlines, with preemptible prefill: --preemption-granularity), or your own "
        "Policy class as package.module:Class (docs/custom_policy.md)",
        flags=("--scheduling", "--scheduler-cls"), metavar="POLICY")
    max_model_len: int | None = engine_arg(
        None, "longest sequence, prompt and output", type="positive_int",
        default_help=f"min(max_position_embeddings, {DEFAULT_MAX_MODEL_LEN})")
    max_num_seqs: int = engine_arg(32, "most requests running at once", type="positive_int")
    max_num_batched_tokens: int | None = engine_arg(
        None, "prefill token budget of one step; with --data-parallel-size, each data "
        "rank's own under orca, chunked and layered", type="positive_int",
        default_help="the policy's (orca: max_model_len, chunked: 512, layered and "
                     "flowprefill: 8192), capped at max_model_len")
    layer_groups: str | int = engine_arg(
        "paper", "'paper', 'pow2', 'adaptive' (with --tbt-slo-ms) or a fixed group count",
        type="layer_groups")
    # "adaptive": each iteration's span keeps the predicted step within tbt_slo_ms x
    # (1 - adaptive_margin), or the tightest running request's TBT SLO.
    tbt_slo_ms: float | None = engine_arg(
        None, "--layer-groups adaptive: keep each step within this TBT objective (ms)",
        type="positive_float", default_help="no limit")
    adaptive_margin: float = engine_arg(
        0.1, "--layer-groups adaptive: headroom under the TBT objective", type="unit_interval")
    max_layer_groups: int = engine_arg(16, "most layer groups a prefill is split into",
                                 type="positive_int")
    preemption_granularity: str = engine_arg(
        "operator", "where a flowprefill prefill may be paused",
        choices=("operator", "layer", "group"))
    preemptible: bool = engine_arg(
        False, "layered: a prefill batch may be preempted at its group boundaries")
    slo_alpha: float = engine_arg(0.1, "SLO-aware batching's margin, alpha * the TTFT SLO",
                            type="unit_interval")
    flowprefill_rules: str = engine_arg(
        "reference", "flowprefill's ranking and batching: the released FlowPrefill code's "
        "(reference) or lp_jax's earlier ones (SchedulerConfig)",
        choices=("reference", "lp_jax"))
    # Each paused batch holds max_num_batched_tokens rows of the hidden buffer
    # (Qwen3-30B-A3B at 8192 tokens: 32 MiB).
    max_paused_prefills: int = engine_arg(
        8, "paused prefill batches whose hidden states stay on the device",
        type="non_negative_int")
    flowprefill_lookahead: int = engine_arg(
        1, "flowprefill: segments of the running prefill one plan carries (one host plan, "
        "dispatch and commit); an urgent arrival waits for at most k + 1 segments",
        type="positive_int")
    slo_classes: dict | str | None = engine_arg(
        None, "named SLO classes requests may give as slo_class: inline JSON or a JSON "
        'file, e.g. {"chat": {"ttft_ms": 250, "tbt_ms": 100}}', type="slo_classes",
        default_help="none")
    latency_model: str | None = engine_arg(
        None, "fitted step-latency model (python -m lp_jax.engine.profile_latency)",
        type="existing_path", default_help="fitted online")
    prefill_only: bool = engine_arg(
        False, "every request ends at its first token (disaggregated prefill)")
    page_size: int = engine_arg(16, "KV page (block) size, in tokens", type="positive_int")
    enable_prefix_caching: bool = engine_arg(
        True, "share the KV pages of equal prompt prefixes (lp_jax/core/block_manager.py)")
    kv_pages: int | None = engine_arg(None, "KV pages per layer", type="positive_int",
                                default_help="from --kv-memory-fraction")
    kv_memory_fraction: float = engine_arg(
        0.5, "share of the free accelerator memory the KV pool takes, when --kv-pages is "
        "not given", type="positive_float")
    load_format: str = engine_arg("auto", "how the weights are read",
                            choices=("auto", "safetensors", "dummy", "orbax"))
    # A dict of axis sizes too, from Python.
    mesh_shape: tuple | dict | None = engine_arg(
        None, "devices per mesh axis: 'expert,tensor' or 'data,expert,tensor'",
        type="int_tuple", default_help="one device")
    # vLLM's parallel sizes, mapped onto the mesh (sharding.parallel_mesh_shape).
    tensor_parallel_size: int = engine_arg(
        1, "chips that attention heads, the vocabulary and dense MLPs split over; an MoE "
        "model with more than 1 also needs --enable-expert-parallel (not with --mesh-shape)",
        type="positive_int")
    data_parallel_size: int = engine_arg(
        1, "data-parallel attention ranks, each with its own sequences and KV pages; more "
        "than 1 needs --enable-expert-parallel (docs/data_parallel.md)",
        type="positive_int")
    enable_expert_parallel: bool = engine_arg(
        False, "split the experts over every chip (EP = DP x TP, as vLLM's flag)")
    dtype: str | None = engine_arg(None, "weights' and activations' dtype",
                             default_help="the checkpoint's")
    quantization: str | None = engine_arg(
        None, "int8 / fp8: quantise a 16-bit checkpoint per channel at load (an HF FP8 "
        "checkpoint is detected from its config.json); mxfp4: keep GPT-OSS's MXFP4 experts "
        "in 4 bits", flags=("--quantization", "-q"), choices=REQUESTABLE,
        default_help="the checkpoint's format")
    kv_cache_dtype: str = engine_arg(
        "auto", "fp8 / fp8_e4m3: float8_e4m3fn KV pages with the checkpoint's k_scale / "
        "v_scale (else 1.0), half the bytes per page (lp_jax/models/kv_cache.py)",
        choices=KV_CACHE_DTYPES)
    moe_backend: str = engine_arg("auto", "MoE kernel backend (lp_jax/backend_select.py)")
    moe_dispatch: str = engine_arg(
        "auto", "expert-parallel MoE communication: allreduce (every expert shard routes "
        "every token), all_to_all (rows go to their expert's shard and back), auto (fewer "
        "bytes per layer)", choices=("auto", "allreduce", "all_to_all"))
    attention_backend: str = engine_arg(
        "auto", "attention kernel backend (lp_jax/backend_select.py)")
    backends: str = engine_arg(
        "fallback", "start-up self-test of the Pallas kernels: fall back to a safe backend, "
        "fail, or skip it", choices=("fallback", "strict", "off"))
    seed: int = engine_arg(0, "sampling seed")
    token_buckets: tuple[int, ...] | None = engine_arg(
        None, "row counts to compile a step program for", type="int_tuple",
        default_help="1, 4, 16, 64, powers of two to 512, then x1.5 steps to the budget")
    warmup: bool = engine_arg(True, "compile every program at start-up")
    async_scheduling: bool = engine_arg(
        True, "plan and dispatch the next step while a decode-only step runs; off: commit "
        "each step before planning the next")
    # A cache JAX already has (JAX_COMPILATION_CACHE_DIR, or an earlier engine in the
    # process) is kept.
    compilation_cache_dir: str | None = engine_arg(
        help="persistent XLA compilation cache; '' for none", factory=default_jax_cache_dir,
        default_help=f"${CACHE_ENV}/jax_cache, else $XDG_CACHE_HOME/lp_jax/jax_cache, else "
                     "~/.cache/lp_jax/jax_cache", empty_is_none=True, metavar="DIR")
    # One SPMD engine over several processes (distributed.py); process 0 leads
    # (plan_channel.py). All None: a TPU pod or SLURM job JAX detects, else one process.
    num_processes: int | None = engine_arg(
        None, "processes (one per host) of one engine", type="positive_int",
        default_help="$LP_NUM_PROCESSES, a detected TPU pod or SLURM job, or 1")
    process_id: int | None = engine_arg(None, "this process's rank", type="non_negative_int",
                                  default_help="$LP_PROCESS_ID")
    coordinator_address: str | None = engine_arg(None, "host:port of process 0",
                                           default_help="$LP_COORDINATOR_ADDRESS")
    plan_channel: str = engine_arg(
        "host", "how the leader sends each step to the followers: host (TCP) or device "
        "(broadcast_one_to_all)", choices=("host", "device"))
    follower_timeout_s: float = engine_arg(60.0, "a follower silent this long stops the leader",
                                     type="positive_float")
    trace_path: str | None = engine_arg(
        None, "write the decision trace (one JSON line per plan and request event) here; "
        "python -m lp_jax.trace plot PATH draws it", flags=("--trace", "--trace-path"),
        metavar="PATH", default_help="none")
    # Scheduler time advanced by the latency estimator's predicted step times instead of
    # wall time (core/clock.py): arrivals, deadlines and metrics on it, reproducible.
    # From Python only (tests and the simulator).
    virtual_clock: bool = False
    # lp_jax/spec/config.py checks it (a dict, its JSON, or a SpeculativeConfig).
    speculative_config: dict | str | SpeculativeConfig | None = engine_arg(
        None, 'speculative decoding, vLLM\'s JSON: {"method": "ngram", '
        '"num_speculative_tokens": k, "prompt_lookup_min": n, "prompt_lookup_max": m} or '
        '{"method": "eagle3", "model": head_dir, "num_speculative_tokens": k} or '
        '{"method": "mtp", "num_speculative_tokens": k} '
        "(docs/speculative.md)", type="speculative_config", default_help="off")

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
        parallel_mesh_shape(**self.parallel_sizes(), has_experts=None)  # raises on a conflict
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

    def parallel_sizes(self) -> dict:
        """The layout arguments of `sharding.parallel_mesh_shape`."""
        return dict(tensor_parallel_size=self.tensor_parallel_size,
                    data_parallel_size=self.data_parallel_size,
                    enable_expert_parallel=self.enable_expert_parallel,
                    mesh_shape=self.mesh_shape)

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Like the constructor, but names the unknown argument instead of a TypeError."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise TypeError(f"unknown engine arguments {unknown}; valid: {sorted(fields)}")
        return cls(**kwargs)
