"""python -m lp_jax.aot: compile the engine's programs for a TPU slice or a GPU, and audit them.

    python -m lp_jax.aot --platform cuda --preset qwen3-30b-a3b --scheduling layered \\
        --out runs/aot/h200            # --gpu h100; exports only if the CUDA plugin is absent
    python -m lp_jax.aot --platform tpu --topology v6e:2x4 --mesh 1,8,1 \\
        --preset qwen3-30b-a3b --out runs/aot/v6e-8
    python -m lp_jax.aot --platform tpu --topology v6e:2x4 --tensor-parallel-size 8 \\
        --enable-expert-parallel --preset qwen3-30b-a3b --out runs/aot/v6e-8-tp8

No weights are needed: a preset (checkpoints/configs/) or a config.json, plus the engine
arguments that shape the programs. Exits 1 on an audit violation, 2 on a configuration
that cannot fit or compile.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from lp_jax.aot import PRESETS, AotConfig, load_config, run
from lp_jax.aot.audit import describe
from lp_jax.sharding import MESH_AXES, parallel_mesh_shape
from pallas_kernels.compile_targets import GPU_TARGETS


def _host_backend_cpu() -> None:
    """The programs compile for compile-only devices (a TPU topology, a GPU target
    config); the host runs nothing but CPU. Naming it before any backend starts keeps a
    CUDA plugin on a host without a GPU (no cuDNN) from failing its version check, which
    unregisters the plugin and with it the GPU topology ("topology not implemented")."""
    if not os.environ.get("JAX_PLATFORMS"):
        import jax

        jax.config.update("jax_platforms", "cpu")


# The engine flags that shape the programs, as `lp serve` spells them (docs/engine_args.md).
ENGINE_FLAGS = ("scheduling", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                "page_size", "kv_pages", "mesh_shape", "max_paused_prefills", "dtype",
                "quantization", "kv_cache_dtype", "moe_dispatch", "token_buckets",
                "speculative_config")
# vLLM's parallel sizes: they choose the mesh (_mesh), not AotConfig fields of their own.
LAYOUT_FLAGS = ("tensor_parallel_size", "data_parallel_size", "enable_expert_parallel")
# Compile-only defaults: a 4,096-token context and a mesh over the whole slice keep the
# documented commands within one chip's memory for the big presets.
DEFAULTS = {"max_model_len": 4096}
DEFAULT_HELP = {"mesh_shape": "every device of the TPU slice on the expert axis, one device "
                              "for cuda",
                "kv_pages": "max-num-seqs full-length sequences"}


def build_parser(prog: str = "python -m lp_jax.aot") -> argparse.ArgumentParser:
    from lp_jax.engine_args import add_engine_args

    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("--platform", choices=("tpu", "cuda"), required=True)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=sorted(PRESETS))
    src.add_argument("--config", help="a config.json, or a directory holding one")
    ap.add_argument("--topology", default="v6e:2x4", help="TPU slice, e.g. v6e:2x4, v5e:4x4")
    ap.add_argument("--gpu", default="h200", choices=GPU_TARGETS,
                    help="cuda: the GPU's target config (default h200)")
    ap.add_argument("--memory-fraction", type=float,
                    default=float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75)),
                    help="cuda: HBM share of JAX's allocator that weights, KV pool and "
                         "temporaries must fit (default $XLA_PYTHON_CLIENT_MEM_FRACTION or "
                         "JAX's 0.75)")
    ap.add_argument("--keep-dumps", action="store_true",
                    help="cuda: keep the compilers' dumps (OUT/dumps/program_N)")
    ap.add_argument("--jobs", type=int, default=None,
                    help="programs compiled at once (default: the host's cores)")
    ap.add_argument("--out", required=True)
    add_engine_args(ap.add_argument_group("engine (EngineConfig; docs/engine_args.md)"),
                    only=ENGINE_FLAGS + LAYOUT_FLAGS, defaults=DEFAULTS, default_help=DEFAULT_HELP,
                    extra_spellings={"mesh_shape": ("--mesh",)})
    return ap


def main(argv=None, prog: str = "python -m lp_jax.aot") -> int:
    _host_backend_cpu()
    args = build_parser(prog).parse_args(argv)

    try:
        model_cfg = load_config(args.preset or args.config)
        cfg = aot_config(args, model_cfg)
        summary = run(model_cfg, cfg, Path(args.out), jobs=args.jobs,
                      keep_dumps=args.keep_dumps)
    except (ValueError, RuntimeError) as e:
        message = str(e)
        print(f"error: {message[:2000]}{' ...' if len(message) > 2000 else ''}", file=sys.stderr)
        return 2
    print(describe(summary))
    compiled = sum(1 for p in summary["programs"] if p.get("optimized_hlo_file"))
    print(f"wrote {args.out}/summary.json and {summary['num_programs']} StableHLO files"
          + (f", {compiled} optimized HLO files (python -m lp_jax.roofline --aot {args.out})"
             if compiled else ""))
    return 1 if summary["violations"] else 0


def aot_config(args, model_cfg=None) -> AotConfig:
    """AotConfig from the parsed flags: the engine flags under their own names (AotConfig
    names its fields as EngineConfig does), then the compile target's. `model_cfg` (read
    from --preset / --config when not given) says whether the model has experts."""
    from lp_jax.engine_args import engine_kwargs

    if model_cfg is None:
        model_cfg = load_config(args.preset or args.config)

    engine = engine_kwargs(args, ENGINE_FLAGS) | {
        "mesh_shape": _mesh(args, model_cfg), "token_buckets": args.token_buckets or None}
    return AotConfig(platform=args.platform, topology=args.topology, gpu=args.gpu,
                     memory_fraction=args.memory_fraction, **engine)


def _mesh(args, model_cfg=None) -> tuple[int, int, int]:
    """--mesh / --mesh-shape, or vLLM's parallel sizes mapped onto the mesh
    (sharding.parallel_mesh_shape), else the compile target's default."""
    sized = (args.tensor_parallel_size, args.data_parallel_size,
             args.enable_expert_parallel) != (1, 1, False)
    if args.mesh_shape or sized:
        if model_cfg is None:
            model_cfg = load_config(args.preset or args.config)
        shape = parallel_mesh_shape(
            tensor_parallel_size=args.tensor_parallel_size,
            data_parallel_size=args.data_parallel_size,
            enable_expert_parallel=args.enable_expert_parallel,
            mesh_shape=tuple(args.mesh_shape) if args.mesh_shape else None,
            has_experts=model_cfg.num_experts > 0)
        return tuple(shape[a] for a in MESH_AXES)
    if args.platform == "cuda":
        return (1, 1, 1)
    from pallas_kernels.compile_targets import tpu_topology_devices

    return (1, len(tpu_topology_devices(args.topology)), 1)


if __name__ == "__main__":
    sys.exit(main())
