"""Decode-attention bandwidth benchmark: achieved GB/s against the chip's HBM bandwidth.

Decode attention is memory-bound: each step reads every cached K/V row of every
sequence once. The useful traffic is sum(seq_lens) * 2K * H * itemsize plus q and
the output; GB/s = useful bytes / best time. The peak comes from the roofline table
(lp_jax.roofline.hardware) when the device is in it, else from a measured copy.

    python -m lp_jax.bench.attention_kernels --small          # CPU, seconds
    python -m lp_jax.bench.attention_kernels                  # GPU/TPU, Qwen3-MoE shapes
    python -m lp_jax.bench.attention_kernels --sweep          # GPU: kernel configs, 32 x 4096

`bench_decode_attention` is the importable piece (launch/bench_kernels.py may call it);
`sweep_gpu_decode` times the Triton decode kernel's splits, block, warps and stages at
one point (BENCHMARKS.md, "GPU decode attention: bandwidth estimate", says why).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import attention
from pallas_kernels.timing import time_call


def decode_inputs(*, batch, context, num_heads, num_kv_heads, head_dim, page_size, dtype,
                  seed=0):
    """Random decode batch: every sequence has `context` tokens on scattered pages."""
    pages_per_seq = -(-context // page_size)
    P = batch * pages_per_seq + 1
    rng = np.random.default_rng(seed)
    page_table = rng.permutation(P)[: batch * pages_per_seq].reshape(batch, pages_per_seq)
    key_q, key_kv = jax.random.split(jax.random.PRNGKey(seed))
    q = jax.random.normal(key_q, (batch, num_heads, head_dim), jnp.float32).astype(dtype)
    kv = jax.random.normal(key_kv, (P, page_size, 2 * num_kv_heads, head_dim),
                           jnp.float32).astype(dtype)
    seq_lens = jnp.full((batch,), context, jnp.int32)
    return q, kv, seq_lens, jnp.asarray(page_table, jnp.int32)


def useful_bytes(*, batch, context, num_heads, num_kv_heads, head_dim, dtype) -> int:
    item = jnp.dtype(dtype).itemsize
    kv = batch * context * 2 * num_kv_heads * head_dim * item
    return kv + 2 * batch * num_heads * head_dim * item  # + q read + o written


def _best_seconds(fn, repeats):
    return time_call(fn, iters=repeats).best


def bench_decode_attention(*, batch, context, num_heads=32, num_kv_heads=4, head_dim=128,
                           page_size=16, dtype=jnp.bfloat16, backend="auto", repeats=5,
                           peak_bw=None):
    """Times one decode-attention call; returns a dict with seconds, bytes, GB/s and
    the fraction of `peak_bw` (B/s; omitted when None)."""
    def decode(q, kv, l, pt):
        return attention.decode_attention(q, kv, l, pt, sm_scale=head_dim**-0.5,
                                          backend=backend)

    row = _time_decode(decode, batch=batch, context=context, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                       dtype=dtype, repeats=repeats, peak_bw=peak_bw)
    return dict(backend=attention.resolve_backend(backend), **row)


# (splits, pages per block, warps, stages) of the Triton decode kernel; None: its default.
GPU_SWEEP = [dict(num_splits=s, pages_per_block=p, num_warps=w, num_stages=st)
             for s in (None, 1, 4, 8) for p in (4, 8) for w, st in ((4, 2), (4, 3), (8, 2))]


def sweep_gpu_decode(*, batch, context, configs=GPU_SWEEP, num_heads=32, num_kv_heads=4,
                     head_dim=128, page_size=16, dtype=jnp.bfloat16, repeats=5,
                     peak_bw=None):
    """Times the GPU (Triton) decode kernel under each config (keyword arguments of
    gpu.decode_attention); one row per config, fastest first. Runs the kernel in the
    Pallas interpreter when attention.interpret_enabled() (CPU smoke runs)."""
    from pallas_kernels.attention import gpu

    rows = []
    for config in configs:
        kwargs = {k: v for k, v in config.items() if v is not None}

        def decode(q, kv, l, pt, kwargs=kwargs):
            return gpu.decode_attention(q, kv, l, pt, sm_scale=head_dim**-0.5,
                                        interpret=attention.interpret_enabled(), **kwargs)

        rows.append(dict(config, **_time_decode(
            decode, batch=batch, context=context, num_heads=num_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, dtype=dtype,
            repeats=repeats, peak_bw=peak_bw)))
    return sorted(rows, key=lambda row: row["seconds"])


def _time_decode(decode, *, batch, context, num_heads, num_kv_heads, head_dim, page_size,
                 dtype, repeats, peak_bw):
    q, kv, seq_lens, page_table = decode_inputs(
        batch=batch, context=context, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, page_size=page_size, dtype=dtype)
    fn = jax.jit(decode)
    seconds = _best_seconds(lambda: fn(q, kv, seq_lens, page_table), repeats)
    nbytes = useful_bytes(batch=batch, context=context, num_heads=num_heads,
                          num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
    row = dict(batch=batch, context=context, seconds=seconds, bytes=nbytes,
               gbps=nbytes / seconds / 1e9)
    if peak_bw:
        row["fraction_of_peak"] = nbytes / seconds / peak_bw
    return row


def peak_bandwidth(hardware_name=None):
    """(name, B/s): the roofline-table entry named, or the one matching the device kind
    ("NVIDIA H200" -> H200 SXM, "TPU v6 lite" -> TPU v6e), else a measured copy."""
    from lp_jax.roofline import hardware

    if hardware_name:
        hw = hardware.get_hardware(hardware_name)
        return hw.name, hw.hbm_bw
    kind = getattr(jax.devices()[0], "device_kind", "")
    for name in [kind, kind.replace(" lite", "e"), *kind.split()]:
        try:
            hw = hardware.get_hardware(name)
            return hw.name, hw.hbm_bw
        except KeyError:
            continue
    hw = hardware.measure_current_device()
    return hw.name, hw.hbm_bw


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--backend", default="auto", choices=attention.BACKENDS)
    p.add_argument("--hardware", default=None, help="roofline table entry for the peak")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sweep", action="store_true",
                   help="time the GPU kernel's configs (GPU_SWEEP) at 32 x 4096 instead")
    args = p.parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    if args.sweep:
        return _print_sweep(dtype, args)
    if args.small:
        shapes = dict(num_heads=8, num_kv_heads=2, head_dim=128, page_size=16)
        points = [(4, 256), (16, 512)]
    else:  # Qwen3-30B-A3B attention: 32 query heads, 4 KV heads, head_dim 128
        shapes = dict(num_heads=32, num_kv_heads=4, head_dim=128, page_size=16)
        points = [(1, 8192), (8, 4096), (32, 2048), (32, 4096), (64, 4096), (256, 1024),
                  (256, 4096)]
    name, peak = peak_bandwidth(args.hardware)
    print(f"decode attention, backend={attention.resolve_backend(args.backend)}, {dtype.name}, "
          f"peak {peak / 1e9:.0f} GB/s ({name})")
    print(f"{'batch':>6} {'context':>8} {'ms':>9} {'GB/s':>9} {'% peak':>7}")
    rows = []
    for batch, context in points:
        row = bench_decode_attention(batch=batch, context=context, dtype=dtype,
                                     backend=args.backend, repeats=args.repeats,
                                     peak_bw=peak, **shapes)
        rows.append(row)
        print(f"{batch:>6} {context:>8} {row['seconds'] * 1e3:>9.3f} {row['gbps']:>9.1f} "
              f"{100 * row['fraction_of_peak']:>6.1f}%")
    return rows


def _print_sweep(dtype, args):
    name, peak = peak_bandwidth(args.hardware)
    print(f"gpu decode attention configs, {dtype.name}, 32 x 4096, Qwen3-MoE heads, "
          f"peak {peak / 1e9:.0f} GB/s ({name})")
    print(f"{'splits':>6} {'pages':>5} {'warps':>5} {'stages':>6} {'us':>9} {'GB/s':>9} "
          f"{'% peak':>7}")
    rows = sweep_gpu_decode(batch=32, context=4096, dtype=dtype, repeats=args.repeats,
                            peak_bw=peak)
    for row in rows:
        print(f"{row['num_splits'] or 'auto':>6} {row['pages_per_block']:>5} "
              f"{row['num_warps']:>5} {row['num_stages']:>6} {row['seconds'] * 1e6:>9.1f} "
              f"{row['gbps']:>9.1f} {100 * row['fraction_of_peak']:>6.1f}%")
    return rows


if __name__ == "__main__":
    main()
