"""The ridge recheck on compiled MoE-layer programs (issue #26 §3): compile one MoE layer
of the engine for H100, H200 (XLA:GPU + Mosaic GPU, the Hopper kernel) and TPU v5e, v6e
(libtpu, the Pallas TPU kernel) over a row sweep, and find where each turns compute-bound.

The program is the engine's own MLP half of one Qwen3-30B-A3B decoder layer
(`Qwen3MoeForCausalLM._mlp`: post-attention RMSNorm, the float32 router, `model_moe_ffn`
with the stacked expert weights and a traced layer index, the residual), built from the
real config with num_hidden_layers=1, bf16, one device, every row a real token. One
layer is enough: the layers are identical, and a layer's crossing is per layer.
Devices are compile-only: a TPU topology ("v5e:2x2" / "v6e:2x2", one chip of it) and the
CUDA target configs of lp_jax/aot/gpu_targets; nothing runs. Each program's optimized
HLO is costed by lp_jax.roofline.ridge_compiled (the compiled-program reader; Pallas
calls as their uniform-routing cost estimates) and the sweep's crossing is set against
ridge.compute_bound_tokens.

Chips compile one after another, programs one at a time; each program's cost is cached
in OUT/costs.json (keyed by chip and rows), so a rerun compiles only what is missing.

    nice -n 10 .venv/bin/python launch/ridge_compiled.py --out runs/ridge_compiled
        [--chips h100,h200,v5e,v6e] [--rows 16,32,...,16384] [--keep-hlo]

Writes OUT/costs.json (the cache), OUT/ridge_compiled.json (sweep, crossings, formula
knees per chip), OUT/ridge_compiled.png, and the markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHIPS = {"h100": ("cuda", "h100"), "h200": ("cuda", "h200"),
         "v5e": ("tpu", "v5e:2x2"), "v6e": ("tpu", "v6e:2x2")}
DEFAULT_ROWS = tuple(2**i for i in range(4, 15))  # 16 .. 16384
PRESET = "qwen3-30b-a3b"


def one_layer_config():
    from lp_jax.aot import load_config

    return load_config(PRESET).replace(num_hidden_layers=1, dtype="bfloat16")


class LayerCompiler:
    """The abstract one-layer model on one compile-only device of a chip, and its MoE
    half compiled at any row count."""

    def __init__(self, chip: str):
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from lp_jax.aot import AotConfig, _devices
        from lp_jax.loader import abstract_model, param_shardings
        from lp_jax.models.backends import KernelBackends
        from lp_jax.sharding import make_mesh, replicated

        platform, target = CHIPS[chip]
        aot = (AotConfig(platform="tpu", topology=target) if platform == "tpu"
               else AotConfig(platform="cuda", gpu=target))
        self.cfg = one_layer_config()
        self.mesh = make_mesh(1, 1, 1, devices=_devices(aot)[:1])
        graphdef, abstract = abstract_model(self.cfg, jnp.bfloat16)
        shardings = param_shardings(abstract, self.mesh)
        self.state = jax.tree.map(
            lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)),
            abstract, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
        kernel = "tpu" if platform == "tpu" else "gpu"
        backends = KernelBackends(moe=kernel, attention=kernel)

        def moe_layer(state, x_TD, token_mask_T, layer):
            model = nnx.merge(graphdef, state)
            return model._mlp(layer, x_TD, token_mask_T, backends)

        self.fn = moe_layer
        self.replicated = replicated(self.mesh)

    def compile(self, rows: int) -> tuple[str, float]:
        """(optimized HLO text, compile seconds) of the rows-row program."""
        import jax
        import jax.numpy as jnp

        r = self.replicated
        args = (self.state,
                jax.ShapeDtypeStruct((rows, self.cfg.hidden_size), jnp.bfloat16, sharding=r),
                jax.ShapeDtypeStruct((rows,), jnp.bool_, sharding=r),
                jax.ShapeDtypeStruct((), jnp.int32, sharding=r))
        t0 = time.perf_counter()
        with jax.set_mesh(self.mesh):
            compiled = jax.jit(self.fn).lower(*args).compile()
        return compiled.as_text(), time.perf_counter() - t0


def _hardware(chip: str):
    from lp_jax.roofline.hardware import get_hardware

    return get_hardware(chip)


def sweep(chip: str, rows: list[int], cache: dict, out: Path, keep_hlo: bool, log=print):
    """Compiles what the cache lacks for this chip; returns its LayerCosts."""
    from lp_jax.roofline.model_shape import ModelShape
    from lp_jax.roofline.ridge_compiled import LayerCost, declared_kernel_cost, layer_cost

    entries = cache.setdefault(chip, {})
    missing = [n for n in rows if str(n) not in entries]
    if missing:
        compiler = LayerCompiler(chip)
        shape = ModelShape.from_model_config(compiler.cfg, compiler.cfg.model_type)
        hw = _hardware(chip)
        for n in missing:
            text, seconds = compiler.compile(n)
            c = layer_cost(text, shape, n, hw)
            declared = declared_kernel_cost(text)
            entries[str(n)] = {"cost": c.to_json(), "compile_s": round(seconds, 2),
                               "declared_kernel_flops": sum(d.flops for d in declared),
                               "declared_kernel_bytes": sum(d.bytes_accessed for d in declared),
                               "declared_kernels": len(declared)}
            if keep_hlo:
                (out / "hlo").mkdir(exist_ok=True)
                (out / "hlo" / f"{chip}_{n}.hlo.txt").write_text(text)
            (out / "costs.json").write_text(json.dumps(cache, indent=1))  # after each one
            log(f"  {chip} rows {n:>6}: compile {seconds:6.1f} s, {c.flops / 1e9:9.2f} GFLOP, "
                f"{c.bytes / 1e6:8.1f} MB, I = {c.intensity:6.1f} FLOP/B"
                + (f", declared kernels {sum(d.bytes_accessed for d in declared) / 1e6:.1f} MB"
                   if declared else ""))
    return [LayerCost(**entries[str(n)]["cost"]) for n in rows]


def plot(results: dict, path: Path) -> Path:
    """Program intensity (all bytes; weight bytes dotted) against rows per chip, each
    chip's ridge, the formula's exact intensity, the 512 chunk and the arXiv prompts."""
    import numpy as np

    from lp_jax.roofline.model_shape import ModelShape
    from lp_jax.roofline.plots import _pyplot, _save
    from lp_jax.roofline.ridge import moe_intensity
    from lp_jax.roofline.ridge_compiled import (
        ARXIV_MEDIAN,
        ARXIV_P5,
        ARXIV_P95,
        PAPER_CHUNK,
        sweep_crossings,
    )

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 6))
    cfg = one_layer_config()
    shape = ModelShape.from_model_config(cfg, cfg.model_type)
    rows_T = np.geomspace(16, max(max(c.rows for c in r["costs"]) for r in results.values()), 100)
    ax.plot(rows_T, moe_intensity(shape, rows_T), "k--", lw=1,
            label="formula, exact (uniform): expert GEMMs only")
    markers = "os^vD"
    for k, (color, (name, r)) in enumerate(zip(plt.cm.tab10.colors, results.items(),
                                               strict=False)):
        costs, hw = sorted(r["costs"], key=lambda c: c.rows), r["hardware"]
        xs = [c.rows for c in costs]
        # H100 and H200 compile the same program (so do v5e and v6e, nearly): distinct
        # markers and widths keep both visible
        ax.plot(xs, [c.intensity for c in costs], "-", marker=markers[k % 5], color=color,
                ms=7 - 2 * (k % 2), lw=2.5 - (k % 2), mfc="none" if k % 2 == 0 else color,
                label=f"{name} compiled: flops / all bytes")
        ax.plot(xs, [c.weight_intensity for c in costs], ":", color=color, lw=1)
        ax.axhline(hw.ridge_point, color=color, lw=0.8, ls="-.",
                   label=f"{name} ridge {hw.ridge_point:.0f}")
        cross = sweep_crossings(costs, hw)["all bytes"]
        if cross.crosses:
            ax.plot([cross.rows], [hw.ridge_point], "x", color=color, ms=10, mew=2)
    first = sorted(next(iter(results.values()))["costs"], key=lambda c: c.rows)
    if all(c.kernel_intensity for c in first):  # the same kernels' estimates on every chip
        ax.plot([c.rows for c in first], [c.kernel_intensity for c in first], "-",
                color="grey", lw=1, label="compiled kernels alone: their flops / bytes")
    ax.plot([], [], "k:", lw=1, label="dotted: flops / expert-weight bytes")
    along = ax.get_xaxis_transform()  # x in data, y in axes coordinates
    ax.axvline(PAPER_CHUNK, color="grey", lw=1)
    ax.text(PAPER_CHUNK * 1.05, 0.03, "chunk 512", color="dimgrey", fontsize=8,
            transform=along)
    ax.axvspan(ARXIV_P5, ARXIV_P95, color="grey", alpha=0.12)
    ax.axvline(ARXIV_MEDIAN, color="grey", lw=1, ls="--")
    ax.text(ARXIV_P5 * 1.02, 0.03, "arXiv prompts:\nlayered groups", color="dimgrey",
            fontsize=8, transform=along)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows (tokens) per MoE layer call")
    ax.set_ylabel("FLOP per HBM byte (dotted: per expert-weight byte)")
    ax.set_title("Qwen3-30B-A3B, one MoE layer compiled per chip: intensity vs ridge")
    ax.legend(loc="upper left", fontsize=7, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, plt, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/ridge_compiled")
    ap.add_argument("--chips", default=",".join(CHIPS))
    ap.add_argument("--rows", default=",".join(str(n) for n in DEFAULT_ROWS))
    ap.add_argument("--keep-hlo", action="store_true", help="write OUT/hlo/CHIP_ROWS.hlo.txt")
    args = ap.parse_args(argv)
    chips = [c.strip() for c in args.chips.split(",") if c.strip()]
    unknown = [c for c in chips if c not in CHIPS]
    if unknown or not chips:
        ap.error(f"unknown chips {unknown}; known: {sorted(CHIPS)}")
    try:
        rows = sorted({int(n) for n in args.rows.split(",")})
    except ValueError:
        ap.error(f"--rows must be comma-separated integers, got {args.rows!r}")
    if len(rows) < 2 or rows[0] < 1:
        ap.error("--rows needs at least two positive row counts")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host runs nothing: compile-only
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache_path = out / "costs.json"
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}

    from lp_jax.roofline.model_shape import ModelShape
    from lp_jax.roofline.ridge_compiled import (
        formula_knees,
        intensity_table,
        markdown_table,
        results_json,
    )

    cfg = one_layer_config()
    shape = ModelShape.from_model_config(cfg, cfg.model_type)
    results = {}
    for chip in chips:
        hw = _hardware(chip)
        results[chip] = {"hardware": hw, "costs": sweep(chip, rows, cache, out, args.keep_hlo),
                         "knees": formula_knees(shape, hw)}
    (out / "ridge_compiled.json").write_text(results_json(results))
    png = plot(results, out / "ridge_compiled.png")
    compile_s = [e["compile_s"] for c in chips for n, e in cache[c].items() if int(n) in rows]
    print(f"Qwen3-30B-A3B, one MoE layer (the engine's MLP half), bf16, one device; "
          f"{len(compile_s)} programs, compile {sum(compile_s):.0f} s in all "
          f"(max {max(compile_s):.1f} s); Pallas calls: uniform-routing cost estimates")
    print(markdown_table(results))
    print()
    print(intensity_table(results))
    for chip in chips:
        entries = [cache[chip][str(n)] for n in rows]
        declared = [e for e in entries if e["declared_kernels"]]
        if declared:
            gap = max(abs(e["declared_kernel_bytes"] / e["cost"]["kernel_bytes"] - 1)
                      for e in declared)
            print(f"{chip}: the kernels' declared cost_estimate bytes (HLO) against the "
                  f"reader's: at most {gap:.2%} apart over {len(declared)} programs")
    print(f"wrote {out / 'ridge_compiled.json'} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
