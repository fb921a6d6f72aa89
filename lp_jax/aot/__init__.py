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
* cuda: jax 0.11.2 cannot compile for a GPU it does not have, so each program is
  exported (`jax.export`, platforms=["cuda"]) under an abstract H200: the Mosaic GPU
  kernels are lowered, ptxas does not run. One device only.

Before compiling, the per-device bytes of the weights and the KV pool are checked
against the chip's HBM, and a configuration that cannot fit is refused. After it,
`audit.py` checks every program (see there); the CLI exits non-zero on a violation.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lp_jax.config import ModelConfig
from lp_jax.engine.model_runner import resolve_buckets
from lp_jax.engine.scheduler import POLICIES
from lp_jax.engine.step import StepSpec, empty_inputs, init_counts, make_step
from lp_jax.loader import abstract_model, param_shardings
from lp_jax.models.qwen3_moe import KV_CACHE_AXES, KernelBackends, kv_cache_shape, packs_kv
from lp_jax.roofline.hardware import get_hardware
from lp_jax.sharding import make_mesh, named_sharding, replicated

CONFIG_DIR = Path(__file__).resolve().parents[2] / "checkpoints" / "configs"
PRESETS = {"qwen3-30b-a3b": "Qwen3-30B-A3B.json", "qwen3-235b-a22b": "Qwen3-235B-A22B.json",
           "qwen3-8b": "Qwen3-8B.json", "gpt-oss-20b": "gpt-oss-20b.json"}
CHIPS = {"v5e": "TPU v5e", "v6e": "TPU v6e", "v5p": "TPU v5p", "v4": "TPU v4"}


@dataclasses.dataclass(frozen=True)
class AotConfig:
    """The engine arguments that shape the programs (EngineConfig's names)."""

    platform: str  # "tpu" or "cuda"
    scheduling: str = "layered"
    max_model_len: int = 4096
    max_num_seqs: int = 32
    max_num_batched_tokens: int | None = None  # None: the policy's default
    page_size: int = 16
    kv_pages: int | None = None  # None: max_num_seqs full-length sequences
    mesh_shape: tuple[int, int, int] = (1, 1, 1)  # (data, expert, tensor)
    topology: str = "v6e:2x4"  # TPU slice
    dtype: str | None = None
    token_buckets: tuple[int, ...] | None = None
    max_paused_prefills: int = 8  # flowprefill: row areas of the hidden buffer
    moe_dispatch: str = "auto"  # expert-parallel MoE: allreduce, all_to_all or auto

    def __post_init__(self):
        if self.platform not in ("tpu", "cuda"):
            raise ValueError(f"platform must be tpu or cuda, got {self.platform!r}")
        if self.scheduling not in POLICIES:
            raise ValueError(f"scheduling must be one of {sorted(POLICIES)}")
        if self.platform == "cuda" and math.prod(self.mesh_shape) != 1:
            raise ValueError("--platform cuda exports for one device; meshes compile for tpu")


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


def chip(cfg: AotConfig):
    """The roofline table's entry for the target chip (its HBM size)."""
    if cfg.platform == "cuda":
        return get_hardware("H200 SXM")
    generation = cfg.topology.split(":")[0]
    if generation not in CHIPS:
        raise ValueError(f"unknown TPU generation in {cfg.topology!r}; known: {sorted(CHIPS)}")
    return get_hardware(CHIPS[generation])


def _devices(cfg: AotConfig):
    if cfg.platform == "cuda":
        return jax.devices("cpu")[:1]  # a stand-in: the export names no device
    from pallas_kernels.compile_targets import tpu_topology_devices

    return list(tpu_topology_devices(cfg.topology))


def _shard_bytes(shape, dtype, sharding) -> int:
    local = sharding.shard_shape(shape)
    return math.prod(local) * np.dtype(dtype).itemsize


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


def build(model_cfg: ModelConfig, cfg: AotConfig) -> Build:
    """The abstract engine: program spec, step function and sharded argument shapes.
    Raises ValueError if the weights and KV pool cannot fit the chip's HBM."""
    dtype = jnp.dtype(cfg.dtype or model_cfg.dtype)
    model_cfg = model_cfg.replace(dtype=dtype.name)
    data, expert, tensor = cfg.mesh_shape
    mesh = make_mesh(data, expert, tensor, devices=_devices(cfg))
    budget = cfg.max_num_batched_tokens or POLICIES[cfg.scheduling].budget(cfg)
    max_prefill = max(budget, cfg.max_model_len) if cfg.scheduling == "orca" else budget
    buckets = resolve_buckets(cfg.token_buckets, cfg.scheduling, max_prefill, cfg.max_num_seqs)
    graphdef, abstract_state = abstract_model(model_cfg, dtype)
    shardings = param_shardings(abstract_state, mesh)
    state = jax.tree.map(
        lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)),
        abstract_state, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
    weight_bytes = sum(_shard_bytes(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(state))
    L, S = model_cfg.num_hidden_layers, cfg.page_size
    pages = cfg.kv_pages or cfg.max_num_seqs * math.ceil(cfg.max_model_len / S)
    kernel = "tpu" if cfg.platform == "tpu" else "gpu"
    kv_shape = kv_cache_shape(model_cfg, pages, S, packed=packs_kv(model_cfg, kernel))
    kv_sharding = named_sharding(KV_CACHE_AXES, kv_shape, mesh)
    kv = jax.ShapeDtypeStruct(kv_shape, dtype, sharding=kv_sharding)
    spec = StepSpec(num_layers=L, hidden_size=model_cfg.hidden_size, page_size=S,
                    pages_per_seq=math.ceil(cfg.max_model_len / S),
                    max_num_seqs=cfg.max_num_seqs,
                    hidden_rows=cfg.max_num_seqs
                    + budget * POLICIES[cfg.scheduling].hidden_slots(cfg),
                    buckets=buckets)
    hidden = jax.ShapeDtypeStruct((spec.hidden_rows, model_cfg.hidden_size), dtype,
                                  sharding=replicated(mesh))
    step = make_step(graphdef, spec, KernelBackends(moe=kernel, attention=kernel,
                                                    moe_dispatch=cfg.moe_dispatch),
                     counts_sharding=replicated(mesh))
    per_layer = 0
    if model_cfg.moe_layers:
        mlp = state["model"]["layers"]["mlp"]
        per_layer = sum(_shard_bytes(w.shape[1:], w.dtype, _drop_first(w.sharding))
                        for w in (mlp["experts_gate_up_proj"], mlp["experts_down_proj"]))
    out = Build(spec, step, (state, kv, hidden), mesh, model_cfg, weight_bytes,
                _shard_bytes(kv.shape, kv.dtype, kv.sharding), per_layer)
    hbm = chip(cfg).hbm_bytes
    need = out.weight_bytes_per_device + out.kv_bytes_per_device
    if hbm and need > hbm:
        raise ValueError(
            f"does not fit: {need / 1e9:.1f} GB per device (weights "
            f"{out.weight_bytes_per_device / 1e9:.1f} GB + KV pool "
            f"{out.kv_bytes_per_device / 1e9:.1f} GB) > {hbm / 1e9:.0f} GB HBM of a "
            f"{chip(cfg).name}, mesh (data, expert, tensor) = {cfg.mesh_shape}; use a larger "
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
    """The sampler's token-count state, as the engine holds it (replicated, donated)."""
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated(b.mesh)),
        init_counts(b.spec, b.model_config.vocab_size))


def lower_program(b: Build, cfg: AotConfig, N: int) -> dict:
    """Lowers (and on TPU compiles) the N-row program, with the engine's arguments and
    donations. Returns its record: the StableHLO text, times, sizes, and the TPU's memory
    analysis and optimized HLO."""
    args = (*b.args, _abstract_inputs(b.spec, N, b.mesh), _abstract_counts(b))
    jitted = jax.jit(b.step, donate_argnums=(1, 2, 4))
    rec = {"rows": N}
    t0 = time.perf_counter()
    if cfg.platform == "tpu":
        with jax.set_mesh(b.mesh):
            lowered = jitted.lower(*args)
            rec["stablehlo"] = lowered.as_text()
            rec["lower_s"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            compiled = lowered.compile()
        rec["compile_s"] = time.perf_counter() - t1
        from jax.experimental.serialize_executable import serialize

        rec["serialized_bytes"] = len(serialize(compiled)[0])
        m = compiled.memory_analysis()
        rec["memory"] = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in
                         ("argument", "output", "alias", "temp", "generated_code")}
        rec["optimized_hlo"] = compiled.as_text()
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


def run(model_cfg: ModelConfig, cfg: AotConfig, out_dir: Path, log=print) -> dict:
    """Lowers every program (several at a time: the compilers release the GIL), writes
    out_dir/{program_N.stablehlo.txt, summary.json} and returns the summary (with the
    audit's findings)."""
    from lp_jax.aot.audit import audit_program

    log = log or (lambda *_: None)
    b = build(model_cfg, cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    hosts = len({d.process_index for d in b.mesh.devices.flat})
    log(f"{len(b.spec.buckets)} programs (row buckets {list(b.spec.buckets)}) over "
        f"{b.mesh.devices.size} devices on {hosts} host(s); per device: "
        f"weights {b.weight_bytes_per_device / 1e9:.2f} GB, KV pool "
        f"{b.kv_bytes_per_device / 1e9:.2f} GB")

    def one(N: int) -> dict:
        rec = lower_program(b, cfg, N)
        (out_dir / f"program_{N}.stablehlo.txt").write_text(rec["stablehlo"])
        found = audit_program(rec, b)
        rec.pop("stablehlo")
        rec.pop("optimized_hlo", None)
        rec.update(found)
        mem = rec.get("memory", {})
        log(f"  rows {N:>6}: lower {rec['lower_s']:.1f} s"
            + (f", compile {rec['compile_s']:.1f} s, temp {mem['temp'] / 2**20:.0f} MiB"
               if "compile_s" in rec else "")
            + f", {rec['serialized_bytes'] / 2**20:.1f} MiB serialized"
            + (f", {len(found['violations'])} VIOLATIONS" if found["violations"] else ""))
        return rec

    with ThreadPoolExecutor(max(1, min(len(b.spec.buckets), os.cpu_count() or 1))) as pool:
        programs = list(pool.map(one, b.spec.buckets))
    violations = [f"program {p['rows']}: {v}" for p in programs for v in p["violations"]]
    summary = {
        "config": dataclasses.asdict(cfg), "model": model_cfg.model_type,
        "num_layers": model_cfg.num_hidden_layers, "num_programs": len(programs),
        "devices": b.mesh.devices.size, "hosts": hosts,
        "weight_bytes_per_device": b.weight_bytes_per_device,
        "kv_bytes_per_device": b.kv_bytes_per_device,
        "layer_expert_bytes_per_device": b.layer_expert_bytes_per_device,
        "programs": programs, "violations": violations, "jax": jax.__version__,
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
