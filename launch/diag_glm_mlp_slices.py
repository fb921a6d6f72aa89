"""Which weight slices XLA:TPU materialises in GLM-4.5-Air's MLP half, compiled for a v6e
chip on this host (no TPU needed; libtpu compiles).

The layer loop of lp_jax/models/qwen3_moe.py reduced to its MLP half: a `fori_loop` over
4 layers whose body picks, with `lax.cond` on the layer index, the dense SwiGLU (first
layer) or the shared-expert SwiGLU (the other three), each indexing its stacked weights
by the layer's position in its stack, as `Qwen3MoeForCausalLM._mlp` does; 512 rows,
D = 4096, shared width 1408, bf16. Variants:

  cond          both kinds in the cond, dense width 10944 (GLM-4.5-Air's)
  cond-aligned  the same, dense width 11008 (10944 rounded up to a multiple of 128)
  shared-only   only the shared experts in the cond (the other branch returns zeros)
  dense-only    only the dense MLP in the cond, width 10944

Prints each program's temporary bytes (memory_analysis) and the buffers outside any
fusion shaped like one layer's weight slice (lp_jax/aot/audit.py's
`materialized_layer_slices` rule).

    PYTHONPATH=. .venv/bin/python launch/diag_glm_mlp_slices.py
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels.compile_targets import tpu_topology_devices

L, T, D, FS = 4, 512, 4096, 1408
STACK = np.asarray([0, 0, 1, 2], np.int32)  # layer -> position in its kind's stack
IS_MOE = np.asarray([False, True, True, True])


def swiglu(g_LDF, u_LDF, d_LFD, j, x_TD):
    return (jax.nn.silu(x_TD @ g_LDF[j]) * (x_TD @ u_LDF[j])) @ d_LFD[j]


def program(variant: str):
    def f(x_TD, dg, du, dd, sg, su, sd):
        def body(i, x_TD):
            j = jnp.asarray(STACK)[i]
            shared = lambda: swiglu(sg, su, sd, j, x_TD)
            dense = lambda: swiglu(dg, du, dd, j, x_TD)
            zeros = lambda: jnp.zeros_like(x_TD)
            branches = {"shared-only": (shared, zeros), "dense-only": (zeros, dense)}
            moe_branch, dense_branch = branches.get(variant, (shared, dense))
            return x_TD + jax.lax.cond(jnp.asarray(IS_MOE)[i], moe_branch, dense_branch)
        return jax.lax.fori_loop(0, L, body, x_TD)
    return f


def main():
    mesh = Mesh(np.array(list(tpu_topology_devices("v6e:2x2"))[:1]), ("tensor",))
    rep = NamedSharding(mesh, P())
    for variant in ("cond", "cond-aligned", "shared-only", "dense-only"):
        F = 11008 if variant == "cond-aligned" else 10944
        shapes = [(T, D), (1, D, F), (1, D, F), (1, F, D), (3, D, FS), (3, D, FS), (3, FS, D)]
        args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=rep) for s in shapes]
        compiled = jax.jit(program(variant)).lower(*args).compile()
        slices = {f"{D},{F}", f"{F},{D}", f"{D},{FS}", f"{FS},{D}"}
        found, in_fusion = [], False
        for line in compiled.as_text().splitlines():
            if line and not line[0].isspace() and line.rstrip().endswith("{"):
                in_fusion = "fus" in line.split("(")[0]  # a fused computation's header
            m = re.search(r"= bf16\[([0-9,]+)\]", line)
            if m and not in_fusion and m.group(1) in slices:  # as lp_jax/aot/audit.py
                found.append(m.group(1))
        temp = compiled.memory_analysis().temp_size_in_bytes
        print(f"{variant:13s} temp {temp / 1e6:8.1f} MB   buffers outside fusions shaped "
              f"like a layer's slice: {sorted(found) or 'none'}")


if __name__ == "__main__":
    main()
