"""Does XLA:TPU's schedule of an expert-parallel program change with the kernels' cost
estimates? (issue #26 §1; BENCHMARKS.md, "Kernel cost estimates".)

Compiles a 2-layer decode step for a v6e:2x2 slice (compile-only, libtpu on this host;
mesh data 1 x expert 4 x tensor 1) at Qwen3-30B-A3B widths: per layer a projection,
our paged decode attention kernel, a router and the expert-parallel MoE kernels
(`sharded_moe_ffn`, backend tpu), in a fori_loop over the stacked layers. Once with the
kernels' honest estimates (pallas_kernels/cost.py) and once with each alternative:

  padded: the estimates before issue #26 (MoE: P padded rows, every tile its own
          expert; attention: none)
  x1000:  every honest estimate times 1000 (does the scheduler read them at all?)

and prints each program's cost analysis and whether the scheduled instruction order
(opcodes, in the optimized HLO's order) and the placement of collectives and async
copies differ from the honest one.

    python launch/cost_schedule.py [--dispatch allreduce|all_to_all]
"""

from __future__ import annotations

import argparse
import contextlib
import re
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from lp_jax.models.sharded_kernels import kernel_mesh, sharded_decode_attention, sharded_moe_ffn
from pallas_kernels import compile_targets, cost
from pallas_kernels.attention import tpu as attention_tpu
from pallas_kernels.moe import tpu as moe_tpu

L, T, D, E, A, F = 2, 64, 2048, 128, 8, 768
N, K, H, S, C = 32, 4, 128, 16, 64  # 1,024-token contexts
_ASYNC = re.compile(r"all-reduce|all-to-all|all-gather|collective-permute|copy-start|copy-done"
                    r"|tpu_custom_call")


def _step(dispatch):
    def step(x, kv, lens, pt, w_qkv, w_o, w_r, wgu, wd):
        mesh = kernel_mesh(wgu)

        def layer(l, x):
            q = (x @ w_qkv[l]).reshape(T, N, H)
            o = sharded_decode_attention(mesh, q, kv, lens, pt + l * T * C, sm_scale=H ** -0.5,
                                         backend="tpu")
            x = x + o.reshape(T, N * H) @ w_o[l]
            y, _ = sharded_moe_ffn(mesh, x, (x @ w_r[l]).astype(jnp.float32), wgu, wd, layer=l,
                                   top_k=A, norm_topk_prob=True, backend="tpu",
                                   dispatch=dispatch)
            return x + y

        return jax.lax.fori_loop(0, L, layer, x)

    return step


def _args():
    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    return (sd((T, D), bf), sd((L * T * C, S, 2 * K, H), bf), sd((T,), jnp.int32),
            sd((T, C), jnp.int32), sd((L, D, N * H), bf), sd((L, N * H, D), bf),
            sd((L, D, E), bf), sd((L, E, D, 2 * F), bf), sd((L, E, F, D), bf))


@contextlib.contextmanager
def _estimates(mode: str):
    """The kernels' estimates under `mode` ("honest", "padded", "x1000")."""
    saved = moe_tpu._moe_cost, cost.KernelCost.pallas, attention_tpu.cost
    pallas = cost.KernelCost.pallas
    if mode == "x1000":
        cost.KernelCost.pallas = lambda c: pallas(cost.KernelCost(
            1000 * c.flops, 1000 * c.transcendentals, 1000 * c.bytes_accessed))
    elif mode == "padded":
        def padded(routing, P_, G, *, k, n, glu, lhs_dtype, w_dtype, out_dtype, bias, tm, blocks):
            cols, item = 2 * n if glu else n, jnp.dtype(w_dtype).itemsize
            return pl.CostEstimate(flops=2 * P_ * k * cols, transcendentals=P_ * n if glu else 0,
                                   bytes_accessed=P_ * (k + n) * item
                                   + min(G, P_ // tm) * k * cols * item)

        class _NoEstimate:  # attention_tpu reads cost.paged_attention(...).pallas()
            TPU_ATTENTION = cost.TPU_ATTENTION

            @staticmethod
            def paged_attention(**_):
                return type("None_", (), {"pallas": lambda self: None})()

        moe_tpu._moe_cost, attention_tpu.cost = padded, _NoEstimate
    try:
        yield
    finally:
        moe_tpu._moe_cost, cost.KernelCost.pallas, attention_tpu.cost = saved


def compile_program(dispatch: str, mode: str):
    w = P(None, "expert", None, None)
    with _estimates(mode):
        jax.clear_caches()
        t0 = time.perf_counter()
        compiled = compile_targets.compile_tpu(
            _step(dispatch), _args(), topology="v6e:2x2", mesh_shape=(1, 4, 1),
            axis_names=("data", "expert", "tensor"), in_specs=(P(),) * 7 + (w, w))
        seconds = time.perf_counter() - t0
    return compiled, seconds


def schedule(hlo: str) -> tuple[list[str], list[str]]:
    """(every instruction's opcode in scheduled order, the collectives, async copies and
    Mosaic calls among them)."""
    ops, placed = [], []
    for line in hlo.splitlines():
        m = re.match(r"^\s*(?:ROOT )?%[\w.\-]+ = .*? ([a-z][\w\-]*)\((?:%|\))", line)
        if m:
            ops.append(m.group(1))
            if _ASYNC.search(m.group(1)) or "tpu_custom_call" in line:
                placed.append("mosaic" if "tpu_custom_call" in line else m.group(1))
    return ops, placed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dispatch", default="all_to_all", choices=("allreduce", "all_to_all"))
    args = ap.parse_args()
    base = None
    for mode in ("honest", "padded", "x1000"):
        compiled, seconds = compile_program(args.dispatch, mode)
        c = compiled.cost_analysis()
        ops, placed = schedule(compiled.as_text())
        line = (f"{args.dispatch:10s} {mode:7s} compile {seconds:5.1f} s  flops {c['flops']:.4g}"
                f"  bytes {c['bytes accessed']:.4g}  instructions {len(ops)}")
        if base is None:
            base = ops, placed
            print(line + f"  collectives/async copies/kernels {len(placed)}")
        else:
            same = "same order" if ops == base[0] else "ORDER DIFFERS"
            moved = "same placement" if placed == base[1] else (
                f"PLACEMENT DIFFERS ({len(placed)} vs {len(base[1])} async ops/kernels)")
            print(f"{line}  vs honest: {same}, {moved}")


if __name__ == "__main__":
    main()
