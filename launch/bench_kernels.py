"""Kernel microbenchmarks. MoE section: `moe_ffn` per backend vs the bare grouped matmuls.

    python launch/bench_kernels.py moe                      # platform default backends
    python launch/bench_kernels.py moe --backends xla,gpu --json out.json
    python launch/bench_kernels.py moe --small              # CPU-sized shapes

Shapes: Qwen3-30B-A3B experts (D=2048, F=768, E=128, top-8, bfloat16) over tokens per
call 1, 2, 4, ..., 8192; `--small` uses D=128, F=64, E=16, top-4, tokens 1..256.
Routing: random normal router logits (near-uniform expert load), renormalised top-k.

Rows timed per token count:
  moe_ffn[<backend>]  the whole op: route, dispatch, grouped matmuls, combine.
  ragged_dot          baseline: jax.lax.ragged_dot for gate/up and down on rows already
                      sorted by expert, SiLU*up between (no routing, no combine).
  ragged_dot_mgpu     (Hopper GPU only) the same two matmuls with JAX's shipped
                      Mosaic GPU kernel `jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`.
Each prints time, TFLOP/s (useful FLOPs: 2 * T * top_k * D * 3F) and GB/s of expert
weights (activated experts x 3*D*F*itemsize, each expert's weights counted once).
The Pallas backends need their hardware (tpu / Hopper gpu); on CPU only xla runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels.moe import moe_ffn, resolve_backend  # noqa: E402
from pallas_kernels.moe.ref import dispatch, route  # noqa: E402
from pallas_kernels.timing import time_call  # noqa: E402

QWEN3_30B_A3B = dict(D=2048, F=768, E=128, top_k=8)
SMALL = dict(D=128, F=64, E=16, top_k=4)


def _time(fn, *args, iters: int, warmup: int = 2) -> float:
    """Median wall time of fn(*args) in seconds (fn jitted, outputs blocked on)."""
    return time_call(fn, *args, iters=iters, warmup=warmup).median


def _is_hopper() -> bool:
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


def _mgpu_ragged_dot():
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    def rd(lhs, rhs, group_sizes):
        n = rhs.shape[2]
        block_n = 128 if n % 128 == 0 else 64
        return ragged_dot_mgpu.ragged_dot(
            lhs, rhs, group_sizes=group_sizes, block_m=64, block_n=block_n, block_k=64,
            max_concurrent_steps=4, grid_block_n=1,
        )

    return rd


def _grouped_ffn(matmul):
    def f(x_RD, w_gate_up_EDF2, w_down_EFD, group_sizes_E):
        F = w_down_EFD.shape[1]
        gate_up_RF2 = matmul(x_RD, w_gate_up_EDF2, group_sizes_E)
        h_RF = (jax.nn.silu(gate_up_RF2[:, :F]) * gate_up_RF2[:, F:]).astype(x_RD.dtype)
        return matmul(h_RF, w_down_EFD, group_sizes_E)

    return jax.jit(f)


def bench_moe(args) -> list[dict]:
    shape = SMALL if args.small else QWEN3_30B_A3B
    D, F, E, A = shape["D"], shape["F"], shape["E"], shape["top_k"]
    dtype = jnp.dtype(args.dtype)
    tokens = args.tokens or [2**i for i in range(9 if args.small else 14)]
    platform = jax.default_backend()
    if args.backends:
        backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    else:
        backends = sorted({"xla", resolve_backend("auto")})
    key = jax.random.key(args.seed)
    k1, k2 = jax.random.split(key)
    w_gate_up = (jax.random.normal(k1, (E, D, 2 * F), jnp.float32) / np.sqrt(D)).astype(dtype)
    w_down = (jax.random.normal(k2, (E, F, D), jnp.float32) / np.sqrt(F)).astype(dtype)
    bytes_per_expert = 3 * D * F * dtype.itemsize

    baselines = {"ragged_dot": _grouped_ffn(jax.lax.ragged_dot)}
    if _is_hopper() and dtype.itemsize == 2 and not args.small:
        baselines["ragged_dot_mgpu"] = _grouped_ffn(_mgpu_ragged_dot())

    records = []
    device = jax.devices()[0].device_kind
    print(f"# MoE  D={D} F={F} E={E} top_k={A} dtype={dtype.name} device={device} "
          f"platform={platform}")
    print(f"{'op':<22}{'tokens':>7}{'experts':>8}{'ms':>10}{'TFLOP/s':>10}{'GB/s':>10}")
    for T in tokens:
        kx, kl = jax.random.split(jax.random.fold_in(key, T))
        x_TD = jax.random.normal(kx, (T, D), jnp.float32).astype(dtype)
        logits_TE = jax.random.normal(kl, (T, E), jnp.float32)
        _, expert_ids_TA = route(logits_TE, A, True)
        _, token_ids_R, group_sizes_E = dispatch(expert_ids_TA, E, None)
        activated = int(jnp.sum(group_sizes_E > 0))
        flops = 2.0 * T * A * D * 3 * F
        weight_bytes = activated * bytes_per_expert
        x_RD = x_TD[token_ids_R]

        runs = []
        for b in backends:
            fn = jax.jit(lambda x, l, w1, w2, b=b: moe_ffn(
                x, l, w1, w2, top_k=A, norm_topk_prob=True, backend=b)[0])
            runs.append((f"moe_ffn[{b}]", fn, (x_TD, logits_TE, w_gate_up, w_down)))
        for name, fn in baselines.items():
            runs.append((name, fn, (x_RD, w_gate_up, w_down, group_sizes_E)))

        for name, fn, fn_args in runs:
            try:
                t = _time(fn, *fn_args, iters=args.iters)
            except Exception as e:  # noqa: BLE001 - report and go on with the other rows
                print(f"{name:<22}{T:>7}  FAILED: {type(e).__name__}: {str(e)[:200]}")
                records.append(dict(op=name, tokens=T, error=f"{type(e).__name__}: {e}"))
                continue
            rec = dict(
                op=name, tokens=T, D=D, F=F, E=E, top_k=A, dtype=dtype.name,
                device=device, experts_activated=activated, time_ms=t * 1e3,
                tflops=flops / t / 1e12, weight_gbps=weight_bytes / t / 1e9,
            )
            records.append(rec)
            print(f"{name:<22}{T:>7}{activated:>8}{t * 1e3:>10.3f}"
                  f"{rec['tflops']:>10.3g}{rec['weight_gbps']:>10.4g}")
    return records


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("op", nargs="?", default="moe", choices=["moe"])
    p.add_argument("--backends", default="",
                   help="comma list of moe_ffn backends (default: xla + the platform's)")
    p.add_argument("--small", action="store_true", help="small shapes for CPU runs")
    p.add_argument("--tokens", type=int, nargs="*", help="tokens per call (default powers of 2)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="write the records as JSON")
    args = p.parse_args(argv)
    records = bench_moe(args)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
        print(f"# wrote {len(records)} records to {args.json}")


if __name__ == "__main__":
    main()
