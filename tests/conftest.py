"""Test-wide setup, set before JAX loads: 8 simulated CPU devices for the mesh tests, and
one persistent compilation cache for the whole run.

The cache is a fresh directory per `pytest` run, made by the controlling process and
shared by its xdist workers (they inherit the environment) and by the subprocesses the
tests start, removed at the end. Engines and kernels that several tests build with the
same shapes then compile once per run. A program read back from it still counts as a
compilation for the engine's compile guard (lp_jax/executor/compile_guard.py), so the
"nothing compiles while serving" checks keep their teeth; tests/test_compile_guard.py
proves it.

Time budget per test area (tests/README.md): new tests fit in it or buy time elsewhere.
"""

import gc
import os
import shutil
import tempfile
from pathlib import Path

flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The generated models (demo, tiny presets) live in the checkout's own cache, shared by
# `make demo`, every test and the wheel test (lp_jax/paths.py).
os.environ.setdefault("LP_JAX_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache"))

_CACHE_ENV = "LP_TEST_COMPILATION_CACHE"
_OWN_CACHE = None
if _CACHE_ENV not in os.environ:  # the controlling process (or a run without xdist)
    _OWN_CACHE = os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="lp_jax_test_jit_cache_")
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[_CACHE_ENV]
# Cache every program, however small or quick to compile (the defaults skip those).
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import pytest  # noqa: E402

# Python collects its youngest generation every 700 new container objects; tracing and
# compiling allocate millions, so the collector ran ~2,000 times over three engine files,
# its full collections ~20 times (7.7 s of 75 CPU-seconds). At 20,000: 55 and 4 (1.3 s).
GC_THRESHOLD_GEN0 = 20_000
gc.set_threshold(GC_THRESHOLD_GEN0, *gc.get_threshold()[1:])

# The slowest files first (`make test` runs two xdist workers, a file each at a time):
# longest-first keeps one long file from running alone at the end. Ordered by the
# 2026-12-08 clean-clone run's test time per file (e8c517b, files of 3 s or more; a file
# not named here runs after them, in collection order).
SLOWEST_FIRST = ("test_moe_kernels.py", "test_attention_kernels.py", "test_pallas_end_to_end.py",
                 "test_sharded_kernels.py", "test_quant_loading.py", "test_tpu_compile.py",
                 "test_spec_eagle.py", "test_engine.py", "test_dp_pallas.py", "test_gpt_oss.py",
                 "test_moe_quant.py", "test_gpu_validate.py", "test_glm4_moe.py",
                 "test_spec_mtp.py", "test_kv_fp8.py", "test_aot.py", "test_expert_dispatch.py",
                 "test_deepseek_v3.py", "test_multiprocess.py", "test_kernel_check.py",
                 "test_roofline_compiled.py", "test_parallel_layout.py", "test_programs.py",
                 "test_dp_families.py", "test_golden_parity.py", "test_gpu_compile.py",
                 "test_roofline.py", "test_mesh_parity.py", "test_spec_engine.py",
                 "test_sampler.py", "test_moe_router.py", "test_data_parallel.py",
                 "test_structured_outputs.py", "test_wheel.py", "test_mla_kernels.py",
                 "test_kernel_cost.py", "test_flowprefill.py", "test_chat_harmony.py",
                 "test_demo.py", "test_moe_quant_gpu_fp4.py", "test_quant_golden.py",
                 "test_scheduler.py", "test_server_hardening.py", "test_spec.py",
                 "test_program_memory.py", "test_server_api.py", "test_server_mock.py",
                 "test_soak_engine.py", "test_sim_muxwise.py", "test_compile_guard.py")


def pytest_configure(config):
    # xdist (3.6 and later) hands out files by their number of tests, most first, unless
    # told not to: that put the long files of few tests (the wheel, gpu_validate, the
    # compiled roofline) last, each running alone at the end. It keeps the order above.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: keeps order


# XLA:CPU compiles at -O0 (LLVM's cheap pipeline) in tests: the suite is compile-bound
# (tiny engines whose programs run for milliseconds after seconds of LLVM, and Pallas
# kernels interpreted as many small programs), and -O0 cuts its CPU time by about a
# fifth to a half per file (docs/benchmarks/ci.md). Only XLA:CPU programs change: the
# compile-only TPU and GPU programs keep their compilers' defaults, and the HLO passes
# are the same at every level. LP_TEST_CPU_O0=0 runs everything at XLA's default.
_cpu_o0 = os.environ.get("LP_TEST_CPU_O0", "1") == "1"
# The same level for the CPU-only subprocesses a test starts (XLA_FLAGS reach every
# backend of a process, so only processes that compile for no chip take them).
CPU_O0_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
                    if _cpu_o0 else "")


def _install_cpu_o0():
    """Wraps jax's compile options so that XLA:CPU programs compile at -O0 (the
    persistent cache keys on the options, so no program of another level is read)."""
    from jax._src import compiler

    get = compiler.get_compile_options

    def get_compile_options(*args, backend=None, **kwargs):
        options = get(*args, backend=backend, **kwargs)
        if backend is not None and backend.platform == "cpu":
            debug = options.executable_build_options.debug_options
            debug.xla_backend_optimization_level = 0
            debug.xla_llvm_disable_expensive_passes = True
        return options

    compiler.get_compile_options = get_compile_options


if _cpu_o0:
    _install_cpu_o0()


def pytest_collection_finish(session):
    """What collection built (JAX, the engine's modules, every test module: ~350,000
    objects) lives until the process ends: frozen, the garbage collector no longer walks
    it, so a full collection (each module's end, and Python's own when objects pile up)
    costs a fraction of its ~0.4 s. Frozen objects are still freed by reference counting:
    the few programs compiled at import go when JAX's caches are cleared."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True, scope="module")
def _release_programs_after_each_module():
    """Each module's programs go when it ends (an xdist worker runs ~40 modules, and
    XLA:CPU aborts a process holding ~120 programs); the shared engines hold theirs. What
    survives is frozen too, as at collection: the next module's collections walk only its
    own objects. (Four engine files in one process end with the same 13 live programs,
    the shared engines', frozen or not.)"""
    yield
    import jax

    jax.clear_caches()  # first: a cache entry in a reference cycle is garbage by the collect
    gc.collect()
    gc.freeze()  # what outlives a module (the shared engines) outlives the run


def pytest_unconfigure(config):
    if _OWN_CACHE and not hasattr(config, "workerinput"):
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_dir():
    from checkpoints.make_tiny import ensure_tiny

    return ensure_tiny(preset="tiny")


# Tokens the tiny-deepseek golden greedy outputs repeat (prompt 0 emits 237 three times
# in a row), which `two_token_mtp_dir`'s head drafts, so some drafts stand.
MTP_TWO_TOKENS = (237, 446)


@pytest.fixture(scope="session")
def two_token_mtp_dir(tmp_path_factory):
    """tiny-deepseek-mtp whose shared_head.head has two nonzero rows, v at MTP_TWO_TOKENS[0]
    and -v at [1]: the draft is one or the other by the sign of norm(o) . v, a function of
    every computation before it, so a wrong hidden state, next token, KV entry or drafting
    row flips it half the time (test_spec_mtp, test_multiprocess)."""
    from safetensors.numpy import load_file, save_file

    from checkpoints.make_tiny_mtp import ensure_tiny_mtp

    out = shutil.copytree(ensure_tiny_mtp("tiny-deepseek-mtp"),
                          tmp_path_factory.mktemp("mtp") / "m")
    t = load_file(str(out / "model.safetensors"))
    head = t["model.layers.3.shared_head.head.weight"]
    v = head[0].copy()
    head[:] = 0
    head[MTP_TWO_TOKENS[0]], head[MTP_TWO_TOKENS[1]] = v, -v
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    from lp_jax.loader import load_model

    return load_model(tiny_dir)


# ----------------------------------------------------------------- shared helpers
def make_seq(seq_id, prompt, max_tokens=4, *, decoding=False, **kw):
    """A Sequence of `prompt` (its token ids, or a length n for ids 1..n); `decoding`: its
    prompt computed and one sampled token appended, the state of a request in decode."""
    from lp_jax.core.sampling_params import SamplingParams
    from lp_jax.core.sequence import Sequence

    tokens = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
    s = Sequence(seq_id, tokens, SamplingParams(max_tokens=max_tokens), **kw)
    if decoding:
        s.num_computed_tokens = len(tokens)
        s.token_ids.append(1)
    return s


# The policy engines of the model-family golden tests (test_gpt_oss, test_glm4_moe,
# test_deepseek_v3): one row bucket each, the largest call's. Orca (a whole 40-token prompt
# beside the decodes, up to max_model_len + 4 rows) and chunked hold the same program (no
# carried hidden rows), shared through the run's compilation cache.
GOLDEN_ENGINES = {
    "orca": dict(scheduling="orca", max_num_batched_tokens=32, token_buckets=(84,)),
    "chunked": dict(scheduling="chunked", max_num_batched_tokens=32, token_buckets=(84,)),
    "layered": dict(scheduling="layered", layer_groups=2, max_num_batched_tokens=64,
                    token_buckets=(68,)),
}


def record_drafts(llm) -> list:
    """The list, filled as llm serves, of (tokens so far, the drafts proposed after them)
    for every sequence a step samples and leaves running with no pending tokens."""
    seen, commit = [], llm.engine.scheduler.commit

    def recording(plan, result, now):
        done = commit(plan, result, now)
        for seq in plan.sampling_seqs:
            if not seq.is_finished and not seq.num_pending_tokens:
                seen.append((list(seq.token_ids), seq.draft_tokens))
        return done

    llm.engine.scheduler.commit = recording
    return seen


def run_golden_prompts(engine, golden, max_tokens=32):
    """{prompt index: finished output} of a golden file's three prompts, greedy: prompt 0
    first, prompts 1 and 2 two steps later, so prefills run beside decodes."""
    from lp_jax.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids, outs, step = {}, {}, 0
    while len(outs) < 3:
        if step in (0, 2):
            for i in ((0,) if step == 0 else (1, 2)):
                ids[engine.add_request(golden[f"prompt_{i}"].tolist(), params)] = i
        outs.update({ids[o.request_id]: o for o in engine.step() if o.finished})
        step += 1
    return outs


# Two OpenAI tools with bounded arguments (the tool-call tests of test_structured_outputs
# and test_tool_calls): a forced call's arguments stay short on random weights.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "today's weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 5}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}}}}}


def short_request_ttft(llm, urgent_at=None):
    """A 5-token request's TTFT on `llm`'s virtual clock: alone (urgent_at None), or
    arriving at virtual time `urgent_at` while a 60-token prompt prefills; and the
    predicted step time of each plan that carried the long prompt."""
    from lp_jax.core.sampling_params import SamplingParams
    from lp_jax.core.slo import SLO

    eng = llm.engine
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    ids = {}
    if urgent_at is not None:
        ids[eng.add_request(list(range(1, 61)), one, slo=SLO(100.0))] = "long"
        while eng.clock.now() < urgent_at:
            assert eng.has_unfinished(), "the urgent request would arrive after the prefill"
            eng.step()
    ids[eng.add_request(list(range(100, 105)), one, slo=SLO(10.0),
                        arrival_time=eng.clock.now() if urgent_at is None else urgent_at)] = "s"
    ttft = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                ttft[ids[out.request_id]] = out.metrics.ttft
    lat = eng.scheduler.latency
    long_steps = [lat.predict_plan(p) for p in eng.runner.plans
                  if any(c.num_tokens > 5 for c in p.prefill)]
    return ttft["s"], long_steps


def output_ids(seq) -> list[int]:
    """A Sequence's output token ids (its tokens after the prompt)."""
    return seq.token_ids[seq.num_prompt_tokens:]


def make_sched_cfg(policy, **kw):
    """A SchedulerConfig for host-only scheduler tests (8 layers, 4,096 pages of 4)."""
    from lp_jax.core.config import SchedulerConfig
    from lp_jax.core.policies import resolve_policy

    base = dict(policy=resolve_policy(policy), num_layers=8, max_model_len=4096, page_size=4,
                num_pages=4096, vocab_size=1000, max_num_seqs=16)
    if base["policy"].name == "flowprefill":  # groups: the step-count tests hold for it too
        base["preemption_granularity"] = "group"
    base.update(kw)
    return SchedulerConfig(**base)


def launch_module(name: str):
    """A launch/ script as a module (launch is a package; its scripts run nothing on import)."""
    import importlib

    return importlib.import_module(f"launch.{name}")


def start_server(engine, **kw):
    """An OpenAI server for `engine` on a loopback port, in a background thread."""
    from lp_jax.server import OpenAIServer, ServerThread

    return ServerThread(OpenAIServer(engine, served_model_names=["mock"], **kw)).start()


@pytest.fixture(scope="module")
def mock_server(tiny_dir):
    """The server over a mock engine (max_model_len 64), shared by a test module."""
    from lp_jax.server.mock import MockEngine

    st_ = start_server(MockEngine(model_dir=tiny_dir, max_model_len=64))
    yield st_
    st_.stop()


# ----------------------------------------------------------------- shared engines
# Engines every test that needs "an engine" shares, built once per xdist worker on first
# use. They share their shapes (4 sequences of up to 256 tokens, 64 KV pages) and row
# buckets, so their programs are few and shared through the run's compilation cache:
# orca and chunked hold the same 4- and 16-row programs, and the layered engines differ
# in G only, which is a runtime value. A test that uses one leaves it clean: no request
# unfinished, every page free (tests that fill the prefix cache reset it first). Only
# tests about a configuration (a page count, a dtype, warm-up off) build their own.
ENGINE_BASE = dict(max_num_seqs=4, max_model_len=256, log=None)
SHARED_ENGINES = {
    "orca": dict(scheduling="orca", max_num_batched_tokens=16, token_buckets=(4, 16, 260)),
    "chunked": dict(scheduling="chunked", max_num_batched_tokens=16, token_buckets=(4, 16)),
    "layered": dict(scheduling="layered", layer_groups=2, max_num_batched_tokens=64,
                    token_buckets=(4, 68)),
    "layered-3": dict(scheduling="layered", layer_groups=3, max_num_batched_tokens=64,
                      token_buckets=(4, 68)),
    "layered-4": dict(scheduling="layered", layer_groups=4, max_num_batched_tokens=64,
                      token_buckets=(4, 68)),
    "flowprefill": dict(scheduling="flowprefill", preemption_granularity="layer",
                        max_num_batched_tokens=64, token_buckets=(4, 68)),
    # FlowPrefill with room for a 120-token prompt in one batch beside 8 sequences; the
    # FlowPrefill and SLO tests build variants of it (their own SLO classes), which share
    # its two programs through the cache.
    "flowprefill-128": dict(scheduling="flowprefill", max_num_seqs=8,
                            max_num_batched_tokens=128, token_buckets=(8, 136)),
}


class SharedEngines:
    """`engines(name)`: the run's shared `LLM` of that name, built on first use;
    `engines.kwargs(name)`: its arguments, for a test that builds a variant."""

    def __init__(self):
        self._built = {}

    @staticmethod
    def kwargs(name: str) -> dict:
        """The engine's arguments, the random-weight tiny checkpoint (the golden one) named."""
        from checkpoints.make_tiny import ensure_tiny

        return {"model": str(ensure_tiny(preset="tiny")), **ENGINE_BASE, **SHARED_ENGINES[name]}

    def __call__(self, name: str):
        if name not in self._built:
            from lp_jax import LLM

            self._built[name] = LLM(**self.kwargs(name))
        return self._built[name]


_ENGINES = SharedEngines()


@pytest.fixture(scope="session")
def engines():
    """The shared engines (SHARED_ENGINES), one set per xdist worker."""
    return _ENGINES
