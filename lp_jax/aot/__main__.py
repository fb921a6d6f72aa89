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
from lp_jax.core.policies import POLICIES
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


def main(argv=None) -> int:
    _host_backend_cpu()
    ap = argparse.ArgumentParser(prog="python -m lp_jax.aot", description=__doc__.split("\n")[0])
    ap.add_argument("--platform", choices=("tpu", "cuda"), required=True)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=sorted(PRESETS))
    src.add_argument("--config", help="a config.json, or a directory holding one")
    ap.add_argument("--scheduling", "--scheduler-cls", default="layered",
                    help=f"{', '.join(sorted(POLICIES))}, or a Policy class as "
                         "package.module:Class (its bucket rules shape the programs)")
    ap.add_argument("--max-paused-prefills", type=int, default=8,
                    help="flowprefill: paused batches whose hidden rows the programs hold")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-pages", type=int, default=None,
                    help="pages per layer (default: max-num-seqs full-length sequences)")
    ap.add_argument("--mesh", default=None,
                    help="data,expert,tensor (or expert,tensor); default: every device of "
                         "the TPU slice on the expert axis, one device for cuda")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="vLLM's: attention heads, vocabulary and dense MLPs split over this "
                         "many chips (mesh 1,1,T); with --enable-expert-parallel the experts "
                         "split over the same chips. For a slice of C chips: T = C. KV heads "
                         "fewer than T are kept T/K times, one per chip (docs/parallelism.md)")
    ap.add_argument("--data-parallel-size", type=int, default=1,
                    help="vLLM's; only 1 is compiled yet (replicas: one compile each)")
    ap.add_argument("--enable-expert-parallel", action="store_true",
                    help="vLLM's: split the experts over the tensor-parallel chips (needed "
                         "for an MoE model with --tensor-parallel-size above 1)")
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
    ap.add_argument("--dtype", default=None, help="default: the checkpoint's")
    ap.add_argument("--quantization", default=None, choices=("int8", "fp8", "mxfp4"),
                    help="int8 / fp8 per channel, or mxfp4 (GPT-OSS's experts in 4 bits); "
                         "default: the checkpoint's format")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3"),
                    help="fp8 / fp8_e4m3: float8_e4m3fn KV pages, half the KV pool's bytes "
                         "(default: auto, the model's dtype)")
    ap.add_argument("--moe-dispatch", default="auto", choices=("auto", "allreduce", "all_to_all"),
                    help="expert-parallel MoE communication (default: auto)")
    ap.add_argument("--token-buckets", default=None,
                    help="comma-separated row buckets (default: the engine's)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    try:
        model_cfg = load_config(args.preset or args.config)
        cfg = AotConfig(
            platform=args.platform, scheduling=args.scheduling,
            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size,
            kv_pages=args.kv_pages, mesh_shape=_mesh(args, model_cfg), topology=args.topology,
            gpu=args.gpu, memory_fraction=args.memory_fraction,
            dtype=args.dtype, max_paused_prefills=args.max_paused_prefills,
            moe_dispatch=args.moe_dispatch, quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            token_buckets=(tuple(int(b) for b in args.token_buckets.split(","))
                           if args.token_buckets else None))
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


def _mesh(args, model_cfg) -> tuple[int, int, int]:
    sized = (args.tensor_parallel_size, args.data_parallel_size,
             args.enable_expert_parallel) != (1, 1, False)
    if args.mesh or sized:
        mesh = args.mesh and tuple(int(d) for d in args.mesh.split(","))
        shape = parallel_mesh_shape(
            tensor_parallel_size=args.tensor_parallel_size,
            data_parallel_size=args.data_parallel_size,
            enable_expert_parallel=args.enable_expert_parallel, mesh_shape=mesh or None,
            has_experts=model_cfg.num_experts > 0)
        return tuple(shape[a] for a in MESH_AXES)
    if args.platform == "cuda":
        return (1, 1, 1)
    from pallas_kernels.compile_targets import tpu_topology_devices

    return (1, len(tpu_topology_devices(args.topology)), 1)


if __name__ == "__main__":
    sys.exit(main())
