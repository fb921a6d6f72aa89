"""Ahead-of-time compilation of the engine's programs for devices this host lacks.

`python -m lp_jax.aot` turns a model config (a preset from `checkpoints/configs/` or a
config.json) and engine arguments into the exact program set the engine would compile
(one step program per row bucket, step.py), with no weights: the model is built
abstractly (`nnx.eval_shape`) and every argument is a sharded ShapeDtypeStruct.

* TPU: libtpu's compiler runs on this CPU host against compile-only devices of a named
  slice ("v6e:2x4", "v5e:4x4"; pallas_kernels.compile_targets), Mosaic included. Each
  program reports its compile time, serialized size and `memory_analysis()`. A slice
  of several hosts ("v5e:4x4": 16 chips, 4 hosts) compiles the same way: the compile-only
  devices carry their process index and one program spans them all.
* cuda: with the CUDA plugin and ptxas installed (`pip install -e '.[gpu-compile]'`, no
  GPU needed), every program is compiled for compile-only GPUs made from an XLA target
  config (`--gpu h200`, the default, or `h100`: `gpu_targets/*.txtpb`): one, or a mesh
  of up to one host's 8 (`--data-parallel-size`, `--tensor-parallel-size`, as for a TPU
  slice). XLA:GPU, its Triton, the Mosaic GPU passes and ptxas for sm_90a all run here
  (autotuning, which needs a device, is off). Besides the TPU's figures, each program
  lists its kernels' registers, spills, stack, shared memory, threads and grid
  (`resources.py`, read from the compilers' dumps). Without the plugin each program is
  only exported (`jax.export`, platforms=["cuda"]) under an abstract H200: the Mosaic
  GPU kernels are lowered, ptxas does not run; the first line of the output says which
  (one device).

Before compiling, the per-device bytes of the weights and the KV pool are checked
against the chip's HBM, and a configuration that cannot fit is refused. After it,
`audit.py` checks every program (see there); the CLI exits non-zero on a violation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lp_jax.aot.chips import chip
from lp_jax.aot.draft import abstract_mtp, draft_k
from lp_jax.config import ModelConfig, resolve_kv_cache_dtype
from lp_jax.core.config import SchedulerConfig
from lp_jax.core.policies import resolve_policy
from lp_jax.core.programs import hidden_rows, step_buckets
from lp_jax.executor.step import (
    StepSpec,
    compiler_options,
    counts_sharding,
    empty_inputs,
    init_counts,
    make_step,
)
from lp_jax.loader import abstract_model, param_shardings
from lp_jax.models.backends import KernelBackends
from lp_jax.models.kv_cache import (
    kv_cache_axes,
    kv_cache_shape,
    kv_dtype,
    packs_kv,
    pool_kv_heads,
)
from lp_jax.paths import bundled
from lp_jax.quant import resolve as resolve_quantization
from lp_jax.roofline.model_shape import ModelShape
from lp_jax.sharding import kv_head_replicas, make_mesh, named_sharding, replicated
from lp_jax.spec.config import SpeculativeConfig
from pallas_kernels.compile_targets import GPU_TARGETS
from pallas_kernels.quant import stored_bytes

CONFIG_DIR = bundled("checkpoints") / "configs"
PRESETS = {"qwen3-30b-a3b": "Qwen3-30B-A3B.json", "qwen3-235b-a22b": "Qwen3-235B-A22B.json",
           "qwen3-8b": "Qwen3-8B.json", "gpt-oss-20b": "gpt-oss-20b.json",
           "gpt-oss-120b": "gpt-oss-120b.json", "glm-4.5": "glm-4.5.json",
           "glm-4.5-air": "glm-4.5-air.json", "deepseek-v3": "deepseek-v3.json",
           "kimi-k2": "kimi-k2.json"}


@dataclasses.dataclass(frozen=True)
class AotConfig:
    """The engine arguments that shape the programs (EngineConfig's names)."""

    platform: str  # "tpu" or "cuda"
    scheduling: str = "layered"  # a policy name or package.module:Class
    max_model_len: int = 4096
    max_num_seqs: int = 32
    max_num_batched_tokens: int | None = None  # None: the policy's default; a data rank's
    page_size: int = 16
    kv_pages: int | None = None  # None: max_num_seqs full-length sequences
    mesh_shape: tuple[int, int, int] = (1, 1, 1)  # (data, expert, tensor)
    topology: str = "v6e:2x4"  # TPU slice
    gpu: str = "h200"  # cuda: the target config (gpu_targets/{gpu}.txtpb)
    # cuda: the share of HBM JAX's allocator may use (XLA_PYTHON_CLIENT_MEM_FRACTION,
    # JAX's default 0.75): weights + KV pool + a program's temporaries must fit in it
    memory_fraction: float = 0.75
    dtype: str | None = None
    token_buckets: tuple[int, ...] | None = None
    max_paused_prefills: int = 8  # flowprefill: row areas of the hidden buffer
    moe_dispatch: str = "auto"  # expert-parallel MoE: allreduce, all_to_all or auto
    quantization: str | None = None  # None: the checkpoint's; "int8" / "fp8" / "mxfp4"
    kv_cache_dtype: str = "auto"  # "fp8" / "fp8_e4m3": e4m3 KV pages (half the KV bytes)
    speculative_config: dict | None = None  # MTP drafts in every program (aot/draft.py)

    def __post_init__(self):
        if self.platform not in ("tpu", "cuda"):
            raise ValueError(f"platform must be tpu or cuda, got {self.platform!r}")
        resolve_policy(self.scheduling)  # a name, a Policy class or package.module:Class
        if self.platform == "cuda" and math.prod(self.mesh_shape) > 8:
            raise ValueError("--platform cuda compiles for one host of at most 8 GPUs, got "
                             f"mesh {self.mesh_shape}")
        if self.gpu not in GPU_TARGETS:
            raise ValueError(f"gpu must be one of {GPU_TARGETS}, got {self.gpu!r}")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        resolve_kv_cache_dtype(self.kv_cache_dtype)  # raises ValueError naming the values
        draft_k(self.speculative_config)  # raises ValueError for a method not compiled


def load_config(preset_or_path: str) -> ModelConfig:
    path = Path(preset_or_path)
    if preset_or_path in PRESETS:
        path = CONFIG_DIR / PRESETS[preset_or_path]
    elif path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"{preset_or_path!r} is neither a preset {sorted(PRESETS)} nor a "
                         "config.json (or a directory holding one)")
    return ModelConfig.from_pretrained_file(path)


def cuda_mode() -> str:
    """"compile" where the CUDA plugin and ptxas are installed, else "export"."""
    from pallas_kernels.compile_targets import cuda_compiler_missing

    return "export" if cuda_compiler_missing() else "compile"


def _devices(cfg: AotConfig):
    if cfg.platform == "cuda":
        n = math.prod(cfg.mesh_shape)
        if cuda_mode() == "export":
            if n > 1:
                raise ValueError("a cuda mesh of several GPUs needs the CUDA plugin (compile "
                                 "mode); an export is of one device")
            return jax.devices("cpu")[:1]  # a stand-in: the export names no device
        from pallas_kernels.compile_targets import cuda_topology_devices

        return list(cuda_topology_devices(cfg.gpu, n))
    from pallas_kernels.compile_targets import tpu_topology_devices

    return list(tpu_topology_devices(cfg.topology))


def _shard_bytes(shape, dtype, sharding) -> int:
    """HBM bytes of one device's shard, at the dtype's width in bits: XLA packs 4-bit
    types (MXFP4's e2m1) two a byte, where numpy's itemsize says 1
    (`pallas_kernels.quant.stored_bytes`; the TPU compiler's argument sizes agree)."""
    return stored_bytes(sharding.shard_shape(shape), dtype)


@dataclasses.dataclass
class Build:
    """Everything needed to lower the programs, and the sizes the audit checks against."""

    spec: StepSpec
    step: object  # the step function
    args: tuple  # (state, kv_pages, hidden_RD) as sharded ShapeDtypeStructs
    mesh: object
    model_config: ModelConfig
    weight_bytes_per_device: int
    kv_bytes_per_device: int
    layer_expert_bytes_per_device: int  # one layer's experts on one device
    draft_args: tuple = ()  # an MTP draft's (params, state) as ShapeDtypeStructs
    draft_bytes_per_device: int = 0  # its weights and one-layer KV pool on one device


def scheduler_config(model_cfg: ModelConfig, cfg: AotConfig, num_pages: int) -> SchedulerConfig:
    """The engine's scheduler config for these arguments: its policy sizes the programs.
    A budget left to the policy is the policy's own (the engine caps it at max_model_len,
    lp_jax/engine/config.py; the AOT runs of BENCHMARKS.md predate that rule)."""
    return SchedulerConfig(
        policy=resolve_policy(cfg.scheduling), num_layers=model_cfg.num_hidden_layers,
        max_model_len=cfg.max_model_len, page_size=cfg.page_size, num_pages=num_pages,
        vocab_size=model_cfg.vocab_size, max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_paused_prefills=cfg.max_paused_prefills,
        # under data-parallel attention: budgets a rank, the hidden buffer split over data
        data_parallel_size=cfg.mesh_shape[0],
        speculative_config=SpeculativeConfig.parse(cfg.speculative_config))


def build(model_cfg: ModelConfig, cfg: AotConfig) -> Build:
    """The abstract engine: program spec, step function and sharded argument shapes.
    Raises ValueError if the weights and KV pool cannot fit the chip's HBM."""
    dtype = jnp.dtype(cfg.dtype or model_cfg.dtype)
    model_cfg = model_cfg.replace(dtype=dtype.name, quantization=resolve_quantization(
        model_cfg.quantization, cfg.quantization),
        kv_cache_dtype=resolve_kv_cache_dtype(cfg.kv_cache_dtype))
    data, expert, tensor = cfg.mesh_shape
    mesh = make_mesh(data, expert, tensor, devices=_devices(cfg))
    L, S = model_cfg.num_hidden_layers, cfg.page_size
    pages = cfg.kv_pages or cfg.max_num_seqs * math.ceil(cfg.max_model_len / S)
    if data > 1:  # data-parallel attention: a rank-major pool, an equal share per rank
        model_cfg = model_cfg.replace(kv_ranks=data)
        pages = -(-pages // data) * data
    sched_cfg = scheduler_config(model_cfg, cfg, pages)
    buckets = step_buckets(sched_cfg, cfg.token_buckets)
    graphdef, abstract_state = abstract_model(model_cfg, dtype, mesh)
    shardings = param_shardings(abstract_state, mesh)
    state = jax.tree.map(
        lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)),
        abstract_state, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
    weight_bytes = sum(_shard_bytes(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(state))
    kernel = "tpu" if cfg.platform == "tpu" else "gpu"
    kv_shape = kv_cache_shape(model_cfg, pages, S, packed=packs_kv(model_cfg, kernel),
                              replicas=kv_head_replicas(model_cfg.num_key_value_heads,
                                                        model_cfg.num_attention_heads, mesh))
    kv_sharding = named_sharding(kv_cache_axes(model_cfg), kv_shape, mesh)
    kv = jax.ShapeDtypeStruct(kv_shape, kv_dtype(model_cfg, dtype), sharding=kv_sharding)
    spec = StepSpec(num_layers=L, hidden_size=model_cfg.hidden_size, page_size=S,
                    pages_per_seq=math.ceil(cfg.max_model_len / S),
                    max_num_seqs=cfg.max_num_seqs,
                    hidden_rows=hidden_rows(sched_cfg), buckets=buckets,
                    vocab_size=model_cfg.vocab_size, data_ranks=data,
                    hidden_split=sched_cfg.rank_budgets,
                    draft_k=draft_k(cfg.speculative_config))
    draft, draft_args = None, ()
    if spec.draft_k:
        draft, draft_args = abstract_mtp(
            model_cfg, dtype, mesh, kv_shape, pages=pages, packed=packs_kv(model_cfg, kernel),
            replicas=kv_head_replicas(model_cfg.num_key_value_heads,
                                      model_cfg.num_attention_heads, mesh))
    hidden = jax.ShapeDtypeStruct(
        (spec.hidden_buffer_rows, model_cfg.hidden_size), dtype,
        sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
        if spec.hidden_split else replicated(mesh))
    step = make_step(graphdef, spec, KernelBackends(moe=kernel, attention=kernel,
                                                    moe_dispatch=cfg.moe_dispatch),
                     replicated=replicated(mesh),
                     counts_sharding=counts_sharding(spec, model_cfg.vocab_size, mesh),
                     draft=draft)
    per_layer = 0
    if model_cfg.moe_layers:
        mlp = state["model"]["layers"]["mlp"]
        per_layer = sum(_shard_bytes(w.shape[1:], w.dtype, _drop_first(w.sharding))
                        for w in (mlp["experts_gate_up_proj"], mlp["experts_down_proj"]))
    out = Build(spec, step, (state, kv, hidden), mesh, model_cfg, weight_bytes,
                _shard_bytes(kv.shape, kv.dtype, kv.sharding), per_layer, draft_args,
                sum(_shard_bytes(x.shape, x.dtype, x.sharding)
                    for x in jax.tree.leaves(draft_args)))
    name, hbm = chip(cfg)
    need = out.weight_bytes_per_device + out.kv_bytes_per_device + out.draft_bytes_per_device
    if hbm and need > hbm:
        raise ValueError(
            f"does not fit: {need / 1e9:.1f} GB per device (weights "
            f"{out.weight_bytes_per_device / 1e9:.1f} GB + KV pool "
            f"{out.kv_bytes_per_device / 1e9:.1f} GB) > {hbm / 1e9:.0f} GB HBM of a "
            f"{name}, mesh (data, expert, tensor) = {cfg.mesh_shape}; use a larger "
            "slice and mesh (e.g. --topology v6e:2x4 --mesh 1,8,1), or fewer --kv-pages")
    return out


def _drop_first(sharding):
    """The sharding of one leading slice of an array sharded by `sharding`."""
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))


def _abstract_inputs(spec: StepSpec, N: int, mesh):
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype, sharding=replicated(mesh)),
        empty_inputs(spec, N))


def _abstract_counts(b: Build):
    """The sampler's token-count state, as the engine holds it (on the vocabulary split,
    donated)."""
    on_vocab = counts_sharding(b.spec, b.model_config.vocab_size, b.mesh)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_vocab),
                        init_counts(b.spec, b.model_config.vocab_size))


def lower_program(b: Build, cfg: AotConfig, N: int, dump_dir: Path | None = None) -> dict:
    """Lowers and compiles (TPU; cuda with the plugin) or exports (cuda without it) the
    N-row program, with the engine's arguments and donations. Returns its record: the
    StableHLO text, times, sizes, and for a compile the memory analysis and optimized
    HLO. dump_dir (cuda compiles): XLA dumps this program's PTX and thunk sequence there."""
    args = (*b.args, _abstract_inputs(b.spec, N, b.mesh), _abstract_counts(b), *b.draft_args)
    step = functools.wraps(b.step)(lambda *a: b.step(*a))
    step.__name__ = f"step_rows_{N}"  # names the program's dumps (jit_step_rows_N)
    jitted = jax.jit(step, donate_argnums=(1, 2, 4, 6) if b.draft_args else (1, 2, 4))
    rec = {"rows": N}
    t0 = time.perf_counter()
    if cfg.platform == "tpu" or cuda_mode() == "compile":
        from lp_jax.aot import resources

        # Mosaic GPU dumps a kernel's launch when it lowers it, its ptxas report when it
        # compiles it: both inside the dump directory's scope.
        dumps = (resources.mosaic_dumps(dump_dir / "mosaic") if dump_dir is not None
                 else contextlib.nullcontext())
        with jax.set_mesh(b.mesh), dumps:
            lowered = jitted.lower(*args)
            rec["stablehlo"] = lowered.as_text()
            rec["lower_s"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            options = compiler_options(cfg.platform) | (
                resources.xla_dump_options(dump_dir / "xla") if dump_dir else {})
            compiled = lowered.compile(compiler_options=options or None)
            rec["compile_s"] = time.perf_counter() - t1
        if dump_dir is not None:
            from pallas_kernels.compile_targets import ptxas_path

            t1 = time.perf_counter()
            rec["kernels"] = resources.collect(dump_dir / "xla", dump_dir / "mosaic",
                                               ptxas_path())
            rec["read_kernels_s"] = time.perf_counter() - t1
        from jax.experimental.serialize_executable import serialize

        try:
            rec["serialized_bytes"] = len(serialize(compiled)[0])
        except Exception as e:  # noqa: BLE001 - a compile-only executable may not serialize
            rec["serialized_bytes"], rec["serialize_error"] = None, f"{type(e).__name__}: {e}"
        m = compiled.memory_analysis()
        rec["memory"] = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in
                         ("argument", "output", "alias", "temp", "generated_code")}
        rec["optimized_hlo"] = compiled.as_text()
        rec["cost_analysis"] = _cost_analysis(compiled)
    else:
        from pallas_kernels.compile_targets import H200, pallas_target

        # Pallas kernels lower to custom calls with no cross-version guarantee: an export
        # is for inspection and for the jax version that wrote it.
        checks = [jax.export.DisabledSafetyCheck.custom_call(target)
                  for target in ("mosaic_gpu_v2", "__gpu$xla.gpu.triton")]
        with pallas_target(H200.device_kind, platform=H200.platform, num_cores=H200.num_cores):
            exported = jax.export.export(jitted, platforms=["cuda"], disabled_checks=checks)(
                *args)
        rec["lower_s"] = time.perf_counter() - t0
        rec["stablehlo"] = exported.mlir_module()
        rec["serialized_bytes"] = len(exported.mlir_module_serialized)  # StableHLO bytecode
    return rec


def run(model_cfg: ModelConfig, cfg: AotConfig, out_dir: Path, log=print,
        jobs: int | None = None, keep_dumps: bool = False) -> dict:
    """Lowers and compiles (or exports) every program, writes out_dir/{program_N.stablehlo
    .txt, summary.json} and returns the summary (with the audit's findings). TPU programs
    compile several at a time (the compiler releases the GIL; `jobs`, default the host's
    cores); cuda compiles one at a time, each reading its kernels' resources from its own
    dumps (out_dir/dumps/program_N, removed afterwards unless keep_dumps)."""
    from lp_jax.aot.audit import audit_program

    log = log or (lambda *_: None)
    mode = cuda_mode() if cfg.platform == "cuda" else "compile"
    if cfg.platform == "cuda":
        name, _ = chip(cfg)
        if mode == "compile":
            gpus = math.prod(cfg.mesh_shape)
            log(f"cuda: compiling every program for {gpus if gpus > 1 else 'one'} {name} "
                "(sm_90a) on this host: "
                "XLA:GPU, Triton, Mosaic GPU and ptxas; autotuning off (no device)")
        else:
            from pallas_kernels.compile_targets import cuda_compiler_missing

            log(f"cuda: EXPORT ONLY, nothing is compiled and ptxas does not run: "
                f"{cuda_compiler_missing()}")
    b = build(model_cfg, cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    hosts = len({d.process_index for d in b.mesh.devices.flat})
    log(f"{len(b.spec.buckets)} programs (row buckets {list(b.spec.buckets)}) over "
        f"{b.mesh.devices.size} devices on {hosts} host(s); per device: "
        f"weights {b.weight_bytes_per_device / 1e9:.2f} GB, KV pool "
        f"{b.kv_bytes_per_device / 1e9:.2f} GB"
        + (f", MTP draft (k = {b.spec.draft_k}: weights and one-layer pool) "
           f"{b.draft_bytes_per_device / 1e9:.2f} GB" if b.draft_args else ""))
    reads_kernels = cfg.platform == "cuda" and mode == "compile"

    def one(N: int) -> dict:
        dump = out_dir / "dumps" / f"program_{N}" if reads_kernels else None
        rec = lower_program(b, cfg, N, dump)
        if dump is not None and not keep_dumps:
            shutil.rmtree(dump, ignore_errors=True)
        (out_dir / f"program_{N}.stablehlo.txt").write_text(rec["stablehlo"])
        found = audit_program(rec, b, cfg)
        rec.pop("stablehlo")
        if "optimized_hlo" in rec:
            _write_compiled(rec, b, cfg, out_dir)
        rec.update(found)
        mem = rec.get("memory", {})
        ours = [k for k in rec.get("kernels") or [] if k["ours"]]
        serialized = rec["serialized_bytes"]
        log(f"  rows {N:>6}: lower {rec['lower_s']:.1f} s"
            + (f", compile {rec['compile_s']:.1f} s, temp {mem['temp'] / 2**20:.0f} MiB"
               if "compile_s" in rec else "")
            + (f", {serialized / 2**20:.1f} MiB serialized" if serialized else "")
            + (f", {len(rec['kernels'])} kernels" if rec.get("kernels") else "")
            + (f", {len(found['violations'])} VIOLATIONS" if found["violations"] else ""))
        for k in ours:
            log(f"      {resources.short(k)}")
        return rec

    from lp_jax.aot import resources

    workers = 1 if reads_kernels else max(1, min(len(b.spec.buckets),
                                                 jobs or os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        programs = list(pool.map(one, b.spec.buckets))
    if (out_dir / "dumps").is_dir() and not keep_dumps:
        shutil.rmtree(out_dir / "dumps", ignore_errors=True)
    violations = [f"program {p['rows']}: {v}" for p in programs for v in p["violations"]]
    plan = hbm_plan(b, programs, chip(cfg)[1])
    for line in describe_hbm_plan(plan):
        log(line)
    summary = {
        "config": dataclasses.asdict(cfg), "model": model_cfg.model_type, "mode": mode,
        "target": chip(cfg)[0], "hbm_bytes": chip(cfg)[1],
        "num_layers": model_cfg.num_hidden_layers, "num_programs": len(programs),
        "devices": b.mesh.devices.size, "hosts": hosts,
        "weight_bytes_per_device": b.weight_bytes_per_device,
        "kv_bytes_per_device": b.kv_bytes_per_device,
        "draft_bytes_per_device": b.draft_bytes_per_device,
        "kv_tokens": plan["kv_tokens"], "kv_head_replicas": plan["kv_head_replicas"],
        "hbm_plan": plan,
        "layer_expert_bytes_per_device": b.layer_expert_bytes_per_device,
        "model_shape": dataclasses.asdict(  # what lp_jax.roofline --aot costs against
            ModelShape.from_model_config(model_cfg, model_cfg.model_type)),
        "programs": programs, "violations": violations, "jax": jax.__version__,
    }
    if reads_kernels:
        summary["our_kernels"] = our_kernels(programs)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def hbm_plan(b: Build, programs: list[dict], hbm_bytes: int | None) -> dict:
    """One chip's HBM: weights, KV pool and the largest program's temporaries (compiled
    programs only), beside the chip's HBM, and the KV the whole slice holds: `kv_tokens`,
    pages x page size (the pool is one array; its pages are not split over chips, its
    heads are, so every chip holds all kv_tokens' share of its heads)."""
    kv = b.args[1]
    pages_per_layer = kv.shape[0] // b.model_config.num_hidden_layers
    temps = [p["memory"]["temp"] for p in programs if "memory" in p]
    plan = {"weights": b.weight_bytes_per_device, "kv_pool": b.kv_bytes_per_device,
            "max_temp": max(temps) if temps else None, "hbm": hbm_bytes,
            "kv_tokens": pages_per_layer * kv.shape[1],
            "kv_head_replicas": pool_kv_heads(kv, b.model_config.head_dim)
            // b.model_config.num_key_value_heads,
            "kv_shard_shape": list(kv.sharding.shard_shape(kv.shape))}
    plan["draft"] = b.draft_bytes_per_device  # an MTP layer's weights and pool
    plan["total"] = plan["weights"] + plan["kv_pool"] + plan["draft"] + (plan["max_temp"] or 0)
    return plan


def describe_hbm_plan(plan: dict) -> list[str]:
    """The per-chip HBM plan as printed lines."""
    gb = lambda n: f"{n / 1e9:.2f} GB"  # noqa: E731
    temp = "n/a (not compiled)" if plan["max_temp"] is None else gb(plan["max_temp"])
    lines = [f"per-chip HBM plan: weights {gb(plan['weights'])} + KV pool "
             f"{gb(plan['kv_pool'])} (shard {plan['kv_shard_shape']}, "
             f"{plan['kv_head_replicas']} cop{'y' if plan['kv_head_replicas'] == 1 else 'ies'}"
             f" of each KV head)"
             + (f" + MTP draft {gb(plan['draft'])}" if plan.get("draft") else "")
             + f" + largest temporaries {temp} = {gb(plan['total'])}"
             + (f" of {gb(plan['hbm'])}" if plan["hbm"] else "")]
    lines.append(f"KV the slice holds: {plan['kv_tokens']:,} tokens")
    return lines


def _cost_analysis(compiled) -> dict | None:
    """compiled.cost_analysis() as JSON numbers (None where the backend has none: cuda)."""
    try:
        ca = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without it raises rather than return None
        return None
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else None
    return {k: float(v) for k, v in ca.items()} if ca else None


def _write_compiled(rec: dict, b: Build, cfg: AotConfig, out_dir: Path) -> None:
    """Writes program_N.hlo.txt (optimized HLO) and program_N.cost_analysis.json; the
    record keeps their names, XLA's headline figures (the layer loop counted once, a
    Pallas call as its pl.CostEstimate declares) and each Pallas kernel's cost.py
    estimate at these rows (GPU lowerings drop the declared estimates)."""
    from lp_jax.roofline.compiled import kernel_estimates

    N, text = rec["rows"], rec.pop("optimized_hlo")
    (out_dir / f"program_{N}.hlo.txt").write_text(text)
    rec["optimized_hlo_file"] = f"program_{N}.hlo.txt"
    ca = rec.pop("cost_analysis")
    if ca is not None:
        (out_dir / f"program_{N}.cost_analysis.json").write_text(json.dumps(ca, indent=1))
        rec["cost_analysis"] = {k: ca[k] for k in ("flops", "transcendentals",
                                                   "bytes accessed", "optimal_seconds")
                                if k in ca}
    else:
        rec["cost_analysis"] = None
    rec["pallas_estimates"] = kernel_estimates(text, b.model_config, cfg, N)


def our_kernels(programs: list[dict]) -> list[dict]:
    """Our kernels (Mosaic GPU, Pallas Triton) over all programs: one row per distinct
    (kind, resources), with the row buckets whose programs hold it."""
    rows = {}
    for p in programs:
        for k in p.get("kernels") or []:
            if not k["ours"]:
                continue
            # a Mosaic kernel by its weights' shape (mosaic_gpu:body_N[GxKxNxbf16]): the
            # tile-list grid size varies with the rows, the weights do not
            kind = re.sub(r":body_\d+", "", k["name"])
            key = (kind, k.get("registers"), k.get("spill_stores"), k.get("stack"),
                   k.get("shared_bytes"), tuple(k.get("threads") or ()))
            row = rows.setdefault(key, {**{f: k.get(f) for f in (
                "source", "registers", "spill_stores", "spill_loads", "stack", "shared_bytes",
                "threads", "notes")}, "kernel": kind, "operands": k.get("operands"),
                "grids": [], "programs": []})
            row["programs"].append(p["rows"])
            if k.get("grid") not in row["grids"]:
                row["grids"].append(k.get("grid"))
    return list(rows.values())
