"""Compile sglang-jax's Qwen3-MoE programs for a TPU slice this host does not have.

Runs inside sglang-jax's own venv (its pinned jax and flax), started by
`launch/compare_sglang_jax.py`; it never imports lp_jax. No sglang-jax source is edited:
the harness patches, from outside, what a compile-only run cannot do:

- `jax.devices()` answers with the compile-only devices of the named topology
  (`jax.experimental.topologies.get_topology_desc`);
- `device_array` (every module that imported it) and the KV pool's zero allocator return
  abstract arrays (`jax.ShapeDtypeStruct` with their sharding) instead of device buffers;
- the dummy model loader stops after its `nnx.eval_shape` (its random fill would need
  device memory), and the device-memory probe answers with the chip's HBM;
- `initialize_jit`'s swap of abstract state leaves for empty arrays is skipped (it
  `device_put`s); the harness passes the abstract leaves itself.

The batch is sglang-jax's own precompile dummy (`CompilationManager._make_dummy_batch`),
turned into a ForwardBatch, attention metadata, logits metadata and sampling metadata
by sglang-jax's code. Two programs are lowered per shape, as sglang-jax runs them: the
model (`jitted_run_model`, the LM head included) and the sampler (`jitted_sampler`).
Every private name used is checked first (`require`), so a moved name fails with a
message that names it.

Writes OUT/sglang_<layers>L_<mode><tokens>_{model,sampler}.hlo.txt and OUT/summary.json.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import os
import sys
import time
from pathlib import Path


class MovedName(RuntimeError):
    pass


def require(module: str, *names: str):
    """The named attributes of a sglang-jax module, or a clear error if one moved."""
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise MovedName(f"sglang-jax module {module} is gone ({e}); the harness pins "
                        "its commit: update launch/compare_sglang_jax.py") from e
    missing = [n for n in names if not hasattr(mod, n)]
    if missing:
        raise MovedName(f"sglang-jax moved {module}.{', '.join(missing)}; the harness pins its "
                        "commit: update launch/sglang_jax_compile.py")
    return [getattr(mod, n) for n in names]


def abstract(x, sharding):
    import jax
    import numpy as np
    a = np.asarray(x)
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)


def patch_devices(topology: str):
    import jax
    from jax.experimental import topologies
    devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    jax.devices = lambda *a, **k: list(devices)
    jax.local_devices = lambda *a, **k: list(devices)
    jax.device_count = lambda *a, **k: len(devices)
    jax.local_device_count = lambda *a, **k: len(devices)
    return devices


def patch_sglang(hbm_bytes: int):
    """Every patch of the module docstring; returns nothing, fails on a moved name."""
    import jax
    from flax import nnx

    (device_array,) = require("sgl_jax.srt.utils.jax_utils", "device_array")

    def abstract_device_array(data, sharding=None, **kwargs):
        if sharding is None:
            return jax.tree.map(lambda x: abstract(x, None), data)
        return jax.tree.map(lambda x: abstract(x, sharding), data)

    for name, mod in list(sys.modules.items()):
        if name.startswith("sgl_jax") and getattr(mod, "device_array", None) is device_array:
            mod.device_array = abstract_device_array
    mp = importlib.import_module("sgl_jax.srt.mem_cache.memory_pool")
    require(mp.__name__, "_get_kv_zero_allocator")
    mp._get_kv_zero_allocator = lambda shape, dtype, sharding: (
        lambda: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))

    loader_mod = "sgl_jax.srt.model_loader.loader"
    (dummy,) = require(loader_mod, "JAXDummyModelLoader")

    def eval_shape_only(self, *, model_config):
        model_class = self._initialize_model(model_config)
        kwargs = {"dtype": model_config.dtype, "mesh": self.mesh}
        if "dtype_config" in inspect.signature(model_class.__init__).parameters:
            kwargs["dtype_config"] = getattr(model_config, "dtype_config", None)
        with jax.set_mesh(self.mesh):
            return nnx.eval_shape(lambda: model_class(model_config.hf_config, **kwargs))

    dummy.load_model = eval_shape_only
    (runner,) = require("sgl_jax.srt.model_executor.model_runner", "ModelRunner")
    runner.get_available_device_memory = lambda self: hbm_bytes
    original_init_jit = runner.initialize_jit

    @functools.wraps(original_init_jit)
    def initialize_jit(self):
        put = jax.device_put
        jax.device_put = lambda x, *a, **k: x
        try:
            original_init_jit(self)
        finally:
            jax.device_put = put

    runner.initialize_jit = initialize_jit


def closure_fn(wrapper, name: str):
    fn = inspect.getclosurevars(wrapper).nonlocals.get(name)
    if fn is None or not hasattr(fn, "lower"):
        raise MovedName(f"ModelRunner's wrapper no longer closes over the jitted {name}")
    return fn


def build_runner(args, layers: int, mesh):
    (ServerArgs,) = require("sgl_jax.srt.server_args", "ServerArgs")
    (ModelConfig,) = require("sgl_jax.srt.configs.model_config", "ModelConfig")
    (ModelRunner,) = require("sgl_jax.srt.model_executor.model_runner", "ModelRunner")
    from flax import nnx
    sa = ServerArgs(
        model_path=args.model_dir, load_format="dummy", tp_size=args.tp, ep_size=args.ep,
        page_size=args.page_size, max_total_tokens=args.kv_tokens,
        max_running_requests=args.max_seqs, chunked_prefill_size=args.prefill,
        context_length=args.max_model_len, device="tpu", skip_tokenizer_init=True,
        model_layer_nums=layers, disable_precompile=True, moe_backend=args.moe_backend)
    mc = ModelConfig.from_server_args(sa)
    return ModelRunner(model_config=mc, mem_fraction_static=sa.mem_fraction_static,
                       tp_size=sa.tp_size, dp_size=sa.dp_size, server_args=sa, mesh=mesh,
                       rngs=nnx.Rngs(0), max_padding=args.prefill), sa


def compile_one(runner, sa, mesh, mode_name: str, tokens: int, args, out: Path, tag: str):
    import jax
    from flax import nnx
    (CompilationManager,) = require("sgl_jax.srt.model_executor.compilation_manager",
                                    "CompilationManager")
    (ForwardMode,) = require("sgl_jax.srt.managers.schedule_batch", "ForwardMode")
    (ForwardBatch,) = require("sgl_jax.srt.model_executor.forward_batch_info", "ForwardBatch")
    (LogitsMetadata,) = require("sgl_jax.srt.layers.logits_processor", "LogitsMetadata")
    (SamplingMetadata,) = require("sgl_jax.srt.sampling.sampling_batch_info",
                                  "SamplingMetadata")
    cm = CompilationManager(sa, max_padded_batch_size=args.max_seqs,
                            max_padded_num_tokens=args.prefill, dp_size=1, tp_size=args.tp,
                            page_size=args.page_size, max_req_len=args.max_model_len,
                            vocab_size=runner.model_config.vocab_size,
                            max_total_num_tokens=runner.max_total_num_tokens)
    decode = mode_name == "decode"
    bs = tokens if decode else 1
    i = next(k for k, b in enumerate(cm.bs_buckets) if b >= bs) if decode else -1
    batch = cm._make_dummy_batch(bs, tokens, ForwardMode.DECODE if decode else ForwardMode.EXTEND,
                                 cm.cache_loc_buckets[i], dp_size=1, per_dp_bs_size=bs)
    sampling = SamplingMetadata.from_model_worker_batch(batch, 0, mesh,
                                                        runner.model_config.vocab_size)
    fb = ForwardBatch.init_new(batch, runner)
    runner.attn_backend.forward_metadata = runner.attn_backend.get_forward_metadata(batch)
    logits_md = LogitsMetadata.from_model_worker_batch(batch, mesh)
    model_def, model_state = nnx.split(runner.model)
    leaves, state_def = jax.tree_util.tree_flatten(model_state)
    run_model = closure_fn(runner.jitted_run_model, "jitted_run_model")
    sampler_def, sampler_state = nnx.split(runner.sampler)
    s_leaves, s_def = jax.tree_util.tree_flatten(sampler_state)
    sampler = runner.jitted_sampler.func  # functools.partial over jitted_sampler
    results = {}
    with jax.set_mesh(mesh):
        t0 = time.perf_counter()
        lowered = run_model.lower(model_def, state_def, leaves, fb, runner.memory_pools,
                                  logits_md)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        results["model"] = (compiled, t1 - t0, t2 - t1)
        logits_out = lowered.out_info[0]
    # sglang-jax runs its sampler outside the mesh context (its selects need that)
    t0 = time.perf_counter()
    s_lowered = sampler.lower(sampler_def, s_def, s_leaves, runner.use_sort_for_toppk_minp, 1,
                              logits_out, sampling)
    t1 = time.perf_counter()
    results["sampler"] = (s_lowered.compile(), t1 - t0, time.perf_counter() - t1)
    record = {}
    for part, (c, lower_s, compile_s) in results.items():
        path = out / f"sglang_{tag}_{part}.hlo.txt"
        path.write_text(c.as_text())
        mem = c.memory_analysis()
        record[part] = {"hlo": path.name, "lower_s": round(lower_s, 1),
                        "compile_s": round(compile_s, 1),
                        "memory": {k: int(getattr(mem, k + "_size_in_bytes", 0)) for k in
                                   ("argument", "output", "alias", "temp")}}
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True, help="a directory with config.json")
    p.add_argument("--topology", default="v6e:2x4")
    p.add_argument("--hbm-gib", type=float, default=32.0)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--ep", type=int, default=8)
    p.add_argument("--moe-backend", default="epmoe")
    p.add_argument("--layers", default="1,2")
    p.add_argument("--decode", default="8,64,128")
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--max-seqs", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-tokens", type=int, default=128 * 4096)
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.pop("JAX_PLATFORMS", None)  # sglang-jax's ServerArgs checks it against "tpu"
    import jax
    jax.config.update("jax_platforms", "cpu")  # the host runs nothing; TPUs are compile-only
    devices = patch_devices(args.topology)
    patch_sglang(int(args.hbm_gib * 2**30))
    (create_device_mesh,) = require("sgl_jax.srt.utils.mesh_utils", "create_device_mesh")
    mesh = create_device_mesh(ici_parallelism=[1, args.tp], dcn_parallelism=[1, 1],
                              devices=list(devices))
    summary = {"jax": jax.__version__, "topology": args.topology, "mesh": dict(mesh.shape),
               "kv_tokens": args.kv_tokens, "programs": []}
    shapes = [("decode", int(t)) for t in args.decode.split(",") if t] + [("prefill", args.prefill)]
    runners = {n: build_runner(args, n, mesh) for n in map(int, args.layers.split(","))}
    summary["max_total_num_tokens"] = int(next(iter(runners.values()))[0].max_total_num_tokens)
    for mode, tokens in shapes:  # shape by shape, so that each finished pair is usable
        for layers, (runner, sa) in runners.items():
            tag = f"{layers}L_{mode}{tokens}"
            rec = compile_one(runner, sa, mesh, mode, tokens, args, args.out, tag)
            summary["programs"].append({"layers": layers, "mode": mode, "tokens": tokens, **rec})
            print(f"sglang-jax {tag}: model compile {rec['model']['compile_s']} s, "
                  f"sampler {rec['sampler']['compile_s']} s", flush=True)
            (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
