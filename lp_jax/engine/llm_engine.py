"""LLMEngine: requests in, streamed tokens out; the loop of schedule -> execute -> commit.

The engine owns a `Scheduler` (pure Python policy and bookkeeping) and a
`ModelRunner` (the compiled device step). Each `step()` asks the scheduler for a
plan, has the runner execute it, commits the sampled tokens, and returns one
`RequestOutput` per request that produced a token or finished, so a server can
stream. Bad requests raise ValueError from `add_request` and change nothing.

Overlapped scheduling (`EngineConfig.async_scheduling`, on by default): a step is
left in flight when `step()` returns. The next `step()` plans and dispatches step
k+1 first (its decodes read step k's tokens on device; prefill progress and layered
groups advance at planning, see scheduler.py), and only then waits for step k and
commits it, so the host work of one step runs while the device computes the other.
Each `step()` returns the tokens of the step that completed in it. Where planning
ahead would change the policy's decision (layered: the next plan may form a batch
of several groups from waiting requests, and one arriving meanwhile would wait all
of it), that `step()` only waits and commits, and the next plans with fresh state.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections import OrderedDict
from pathlib import Path

import jax
import numpy as np

from lp_jax import backend_select
from lp_jax.config import ModelConfig, resolve_kv_cache_dtype
from lp_jax.core.clock import VirtualClock, WallClock, nominal_latency
from lp_jax.core.latency import LatencyModel, ModelDims
from lp_jax.core.plan import StepPlan, StepResult
from lp_jax.core.programs import hidden_rows, step_buckets
from lp_jax.core.sampling_params import SamplingParams
from lp_jax.core.scheduler import Scheduler
from lp_jax.core.sequence import Sequence
from lp_jax.core.served import EngineLimits, QueueState
from lp_jax.core.slo import SLO, SLOTracker, parse_slo_classes, request_slo
from lp_jax.engine.config import EngineConfig, default_max_model_len
from lp_jax.engine.outputs import RequestOutput
from lp_jax.executor import compile_guard, distributed
from lp_jax.executor.kernel_check import check_backends, model_experts
from lp_jax.executor.model_runner import ModelRunner, StepHandle
from lp_jax.executor.plan_channel import (
    FollowerChannel,
    LeaderChannel,
    run_follower,
    warm_broadcasts,
)
from lp_jax.models.backends import KernelBackends
from lp_jax.models.kv_cache import kv_page_bytes, packs_kv, read_kv_scales
from lp_jax.paths import no_tokenizer_reason
from lp_jax.quant import resolve as resolve_quantization
from lp_jax.roofline import spec_pays
from lp_jax.sharding import make_mesh, parallel_mesh_shape
from lp_jax.trace.writer import TraceWriter
from pallas_kernels import attention

_KEEP_BATCHES = 256


def _default_model_dir():
    """The embedded default: the small Qwen3-MoE trained on Aesop's fables
    (checkpoints/train_demo.py), made on first use (about a minute) and cached."""
    from checkpoints.train_demo import ensure_demo

    return ensure_demo()


class LLMEngine:
    def __init__(self, config: EngineConfig, *, log=print, executor=None):
        """`executor`: in place of loading the weights and compiling the programs, a
        callable (SchedulerConfig, row buckets, ModelConfig) -> an executor with
        ModelRunner's serving interface (`dispatch`, `warmup`, `memory`, `programs`,
        `compile_seconds`, `row_layers`); tests/fake_executor.py is one, so engine tests
        of scheduling and output plumbing compile nothing. Needs one process."""
        t_start = time.perf_counter()
        backend_select.skip_absent_tpu()  # before the first backend starts
        compile_guard.install()
        # JAX's persistent cache is process-wide and fixed at its first use: one that is
        # already configured (JAX_COMPILATION_CACHE_DIR, an earlier engine) is kept.
        if config.compilation_cache_dir and not jax.config.jax_compilation_cache_dir:
            jax.config.update("jax_compilation_cache_dir", config.compilation_cache_dir)
        self.config = config
        self.log = log or (lambda *_: None)
        model_dir = config.model or _default_model_dir()
        self.model_dir = model_dir
        model_cfg = ModelConfig.from_pretrained(model_dir)
        # The weight format: the checkpoint's, or config.quantization applied at load
        # (lp_jax/quant); a disagreement raises here, before anything loads.
        model_cfg = model_cfg.replace(quantization=resolve_quantization(
            model_cfg.quantization, config.quantization))
        # The KV format (kv_cache.py): e4m3 pages take the checkpoint's k/v scales.
        kv_format = resolve_kv_cache_dtype(config.kv_cache_dtype)
        if kv_format == "fp8":
            model_cfg = model_cfg.replace(kv_cache_dtype="fp8", kv_scales=read_kv_scales(
                None if config.load_format == "dummy" else model_dir, model_cfg))
        if config.data_parallel_size > 1:  # a rank-major pool, split over the data ranks
            model_cfg = model_cfg.replace(kv_ranks=config.data_parallel_size)
        max_model_len = (config.max_model_len
                         or default_max_model_len(model_cfg.max_position_embeddings))
        # Every argument is checked before anything is loaded or compiled; the page count
        # (from free memory once the weights are in) is filled in after loading.
        sched_cfg = config.scheduler_config(model_cfg, max_model_len=max_model_len,
                                            num_pages=config.kv_pages or 1)
        self.slo_classes = parse_slo_classes(config.slo_classes or {})
        dims = ModelDims.from_config(model_cfg)
        latency = (LatencyModel.load(config.latency_model, dims) if config.latency_model
                   else nominal_latency(dims) if config.virtual_clock else LatencyModel(dims))
        # The scheduler's time (core/clock.py); a virtual clock moves by predicted steps.
        self.clock = VirtualClock() if config.virtual_clock else WallClock()
        buckets = step_buckets(sched_cfg, config.token_buckets)  # checked before loading
        self.tokenizer = _load_tokenizer(model_dir)
        self.channel = None
        self._compiles_loaded = compile_guard.compilations()  # _load_and_build moves it on
        if executor is None:
            self.runner, sched_cfg = self._load_and_build(model_cfg, sched_cfg, buckets)
        else:
            if (config.num_processes or 1) > 1:
                raise ValueError("an executor given to LLMEngine runs in one process")
            self.process, self.mesh, self.kernel_report = distributed.SINGLE, None, {}
            self.model_config = model_cfg
            pages = config.kv_pages or config.max_num_seqs * math.ceil(
                max_model_len / config.page_size)
            sched_cfg = dataclasses.replace(sched_cfg, num_pages=pages)
            self.runner = executor(sched_cfg, buckets, model_cfg)
        spec_auto = spec_pays.auto_for_engine(sched_cfg.speculative_config, model_cfg,
                                              max_model_len, log=self.log)  # "auto" k
        self.scheduler = Scheduler(sched_cfg, latency, spec_auto)
        self.structured = self._structured_outputs(model_dir)
        self.trace = None  # the decision trace (lp_jax/trace), with config.trace_path
        if config.trace_path and self.is_leader:
            self.trace = TraceWriter(config.trace_path, source="engine", policy=sched_cfg.name,
                                     num_layers=sched_cfg.num_layers,
                                     clock="virtual" if config.virtual_clock else "wall")
        self.slo_tracker = SLOTracker()
        self._ids = itertools.count()
        self._aborted: list[Sequence] = []  # finished by abort(), reported at the next step
        # Expert bytes of the most recent prefill batches (bounded: servers run for days).
        self._batch_bytes: OrderedDict[int, int] = OrderedDict()
        self._counters = {"experts_activated": 0, "expert_bytes_loaded": 0, "host_seconds": 0.0,
                          "device_seconds": 0.0, "overlapped_host_seconds": 0.0,
                          "overlapped_steps": 0}
        self._inflight: StepHandle | None = None  # a dispatched, uncommitted step
        self._last_done = 0.0  # when the previous step's tokens were collected
        if config.warmup:
            self.runner.warmup(log=self.log)
        if self.process.multi_process:
            if config.plan_channel == "device":  # every process, in the same order
                warm_broadcasts(self.runner.codec.max_message_bytes())
            if self.is_leader:
                self.channel.wait_ready(timeout_s=3600.0)
            else:
                self.channel.ready()
        # Every backend compile of start-up once the weights are in: the KV pool, the step
        # programs (dummy weights compile their own one-off initialisers while loading).
        self._startup_compilations = compile_guard.compilations() - self._compiles_loaded
        self._compiles_while_serving = 0  # any backend compile inside step()
        self.startup_seconds = time.perf_counter() - t_start
        self.log(self.ready_line())

    def _load_and_build(self, model_cfg: ModelConfig, sched_cfg, buckets):
        """Loads the weights, self-tests the kernels, sizes the KV pool and builds the
        ModelRunner (joining the other processes first, if any). Returns the runner and
        the scheduler config with its page count."""
        from lp_jax.loader import load_model

        config = self.config
        # Several processes: JAX's distributed runtime first (before any backend starts);
        # the mesh then spans every process's devices.
        self.process = distributed.initialize(config.num_processes, config.process_id,
                                              config.coordinator_address)
        self.mesh = make_mesh(**parallel_mesh_shape(**config.parallel_sizes(),
                                                    has_experts=model_cfg.num_experts > 0))
        model = load_model(self.model_dir, config=model_cfg, load_format=config.load_format,
                           mesh=self.mesh, dtype=config.dtype)
        self._compiles_loaded = compile_guard.compilations()
        self._draft_model = self._load_draft(model, model_cfg)
        backends, self.kernel_report = check_backends(
            model_cfg, KernelBackends(moe=config.moe_backend, attention=config.attention_backend,
                                      moe_dispatch=config.moe_dispatch),
            model.dtype, page_size=config.page_size, mode=config.backends, log=self.log,
            experts=model_experts(model))  # quantized: the stored weights and their scales
        if model_cfg.kv_cache_dtype == "fp8":  # before any program compiles
            attn = attention.resolve_backend(backends.attention)
            if attn == "tpu_jax":
                raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r}: attention "
                                 "backend 'tpu_jax' (JAX's shipped kernel) does not read an "
                                 "FP8 KV cache; use attention_backend='tpu' or 'xla'")
        # Expert bytes count in the dtype the engine runs, not the checkpoint's.
        self.model_config = model_cfg.replace(dtype=np.dtype(model.dtype).name)
        num_pages = config.kv_pages or self._default_kv_pages(
            model, sched_cfg.max_model_len, packed=packs_kv(model_cfg, backends.attention))
        if not config.kv_pages:  # data-parallel ranks take equal shares of the pool
            num_pages -= num_pages % config.data_parallel_size
        if self.process.multi_process:  # every process must build the same programs
            num_pages, backends = self._join_processes(model_cfg, num_pages, backends)
        sched_cfg = dataclasses.replace(sched_cfg, num_pages=num_pages)
        runner = ModelRunner(
            model, mesh=self.mesh, num_pages=num_pages, page_size=config.page_size,
            max_model_len=sched_cfg.max_model_len, max_num_seqs=config.max_num_seqs,
            token_buckets=buckets, hidden_rows=hidden_rows(sched_cfg),
            backends=backends, seed=config.seed,
            channel=self.channel if self.channel is not None and self.is_leader else None,
            draft=self._draft_model, hidden_split=sched_cfg.rank_budgets)
        return runner, sched_cfg

    def _load_draft(self, model, model_cfg: ModelConfig):
        """(config, params, k) of speculative_config's draft model: an EAGLE-3 head, with
        the target's embedding where the head ships none, or the checkpoint's MTP layer;
        None for n-gram drafts."""
        sc = self.config.speculative_config
        if sc is None or not sc.drafts_on_device:
            return None
        # On every process of a multi-process engine: followers run the same draft programs.
        if sc.method == "mtp":
            return self._load_mtp(model, sc.num_speculative_tokens)
        from lp_jax.models.eagle3 import load_eagle3

        ecfg, params = load_eagle3(sc.model, model_cfg, model.model.embed_tokens[...],
                                   dtype=model.dtype)
        self.log(f"EAGLE-3 draft {sc.model}: aux layers {list(ecfg.aux_layer_ids)}, draft "
                 f"vocabulary {ecfg.draft_vocab_size}, k = {sc.num_speculative_tokens}")
        return ecfg, params, sc.num_speculative_tokens

    def _load_mtp(self, model, k: int):
        """(MtpConfig, MtpParams, k): the checkpoint's next-token layer (loader.load_mtp)."""
        from lp_jax.loader import load_mtp

        if self.config.load_format in ("dummy", "orbax") or not (
                Path(self.model_dir) / "config.json").is_file():
            raise ValueError(f"speculative_config method 'mtp' reads the next-token layers "
                             f"of a Hugging Face checkpoint; load_format "
                             f"{self.config.load_format!r} has none")
        mcfg, params = load_mtp(self.model_dir, model, mesh=self.mesh)
        self.log(f"MTP draft: next-token layer {mcfg.layer} of {Path(self.model_dir).name}, "
                 f"k = {k}")
        return mcfg, params, k

    def _structured_outputs(self, model_dir):
        """The grammar engine (lp_jax/structured) over the model's tokenizer, shared with
        the runner, which fills the constrained rows' bitmasks; None without a tokenizer
        or where the runner cannot apply masks (followers get them through the channel)."""
        path = Path(model_dir) / "tokenizer.json"
        if not (self.is_leader and path.is_file() and hasattr(self.runner, "structured")):
            return None
        from lp_jax.structured.compiler import GrammarCompiler
        from lp_jax.structured.matchers import StructuredOutputs

        cfg = self.model_config
        self.runner.structured = StructuredOutputs(GrammarCompiler(
            path, cfg.vocab_size, cfg.eos_token_ids))
        return self.runner.structured

    def ready_line(self) -> str:
        """One line for the log once the engine can serve: the model, the policy, its
        programs, and where the memory went (weights, KV pool, the carried-hidden buffer)."""
        cfg, r, sc = self.model_config, self.runner, self.scheduler.config
        mem = r.memory()

        def mib(key) -> str:
            return f"{mem[key] / 2**20:,.1f} MiB"

        buckets = r.spec.buckets
        return (f"ready in {self.startup_seconds:.1f} s: {Path(self.model_dir).name} "
                f"({cfg.model_type}, {cfg.num_hidden_layers} layers, {cfg.dtype}), policy "
                f"{sc.name}, {len(r.programs)} programs (rows {buckets[0]}.."
                f"{buckets[-1]}), max_model_len {sc.max_model_len}, max_num_seqs "
                f"{sc.max_num_seqs}, prefill budget {sc.max_num_batched_tokens} tokens"
                f"{' a data rank' if sc.rank_budgets else ''}; "
                f"memory: weights {mib('weights')}, KV {sc.num_pages} pages x {sc.page_size} "
                f"tokens {mib('kv')}, hidden buffer {mib('hidden')}")

    def _join_processes(self, model_cfg: ModelConfig, num_pages: int, backends):
        """Connects the plan channel; the leader's page count and kernel backends (found
        from its own memory and self-test) become every process's, and a follower started
        with other engine arguments stops with an error naming them."""
        config = self.config
        mine = {k: repr(v) for k, v in dataclasses.asdict(config).items()
                if k not in ("process_id", "model", "compilation_cache_dir", "trace_path")}
        mine["model_config"] = repr(model_cfg)
        if self.is_leader:
            self.channel = LeaderChannel(self.process, transport=config.plan_channel,
                                         timeout_s=config.follower_timeout_s)
            self.channel.setup({"engine": mine, "num_pages": num_pages,
                                "backends": [backends.moe, backends.attention]})
            self.log(f"leader of {self.process.num_processes} processes "
                     f"({len(jax.devices())} devices); plan channel: {config.plan_channel}")
            return num_pages, backends
        self.channel = FollowerChannel(self.process, transport=config.plan_channel)
        setup = self.channel.setup()
        diff = sorted(k for k in mine.keys() | setup["engine"].keys()
                      if mine.get(k) != setup["engine"].get(k))
        if diff:
            distributed.fatal(f"started with engine arguments that differ from the "
                              f"leader's: {diff}")
        moe, attention = setup["backends"]
        return setup["num_pages"], dataclasses.replace(backends, moe=moe, attention=attention)

    @property
    def is_leader(self) -> bool:
        return self.process.is_leader

    def serve_follower(self) -> int:
        """A follower's whole life: runs the leader's steps until it stops this engine.
        Returns the number of steps run."""
        if self.is_leader:
            raise RuntimeError("serve_follower runs on follower processes only")
        steps = run_follower(self.runner, self.channel)
        self.channel.close()
        return steps

    def shutdown(self):
        """Stops the followers of a multi-process leader (a no-op otherwise; idempotent)."""
        if self.channel is not None and self.is_leader:
            self.channel.stop()
        if self.trace is not None:
            self.trace.close()

    def _default_kv_pages(self, model, max_model_len: int, packed: bool = False) -> int:
        """Enough pages for max_num_seqs full-length sequences, capped by free memory."""
        cfg, S = self.model_config, self.config.page_size
        want = self.config.max_num_seqs * math.ceil(max_model_len / S)
        stats = jax.local_devices()[0].memory_stats() or {}
        limit = stats.get("bytes_limit")
        if limit:
            free = (limit - stats.get("bytes_in_use", 0)) * self.config.kv_memory_fraction
            # An FP8 page: half of bf16's; a device holds its share of the heads.
            page_bytes = kv_page_bytes(cfg, S, model.dtype, self.mesh, packed=packed)
            if self._draft_model is not None:  # the draft's one-layer pool on the same pages
                page_bytes += page_bytes // cfg.num_hidden_layers
            want = min(want, int(free // page_bytes))
        return max(want, 1)

    # -------------------------------------------------------------- requests
    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    *, priority: int = 0, arrival_time: float | None = None,
                    slo: SLO | str | dict | None = None,
                    prefill_after: int | None = None, index: int = 0) -> int:
        """Queues a request and returns its id; raises ValueError for bad input.

        `slo`: an `SLO`, the name of a configured class (EngineConfig.slo_classes), or a
        dict with any of "slo_class", "ttft_slo_ms", "tbt_slo_ms".
        One request is one sample: a request with `n` > 1 is added as the n requests of
        `sampling_params.samples()` (as `LLM.generate` and the server do), each later one
        with `prefill_after` = the first's id, so that it waits for the first's prefill
        and takes the prompt's pages from the prefix cache, and `index` = i."""
        slo = self.resolve_slo(slo)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(no_tokenizer_reason(self.model_dir))
            token_ids = self.tokenizer.encode(prompt).ids
        else:
            token_ids = list(prompt)
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {sampling_params!r}")
        if sampling_params is not None and sampling_params.n > 1:
            raise ValueError(f"n={sampling_params.n}: add each of sampling_params.samples() "
                             "as its own request (LLM.generate and the server do)")
        leader = None
        if prefill_after is not None:
            leader = self.scheduler.get(prefill_after)
            if leader is not None and leader.token_ids[: leader.num_prompt_tokens] != token_ids:
                raise ValueError(f"prefill_after={prefill_after}: that request's prompt "
                                 "differs from this one")
        if self.config.prefill_only:  # the request ends at its first token
            sampling_params = dataclasses.replace(sampling_params or SamplingParams(),
                                                  max_tokens=1)
        seq = Sequence(next(self._ids), token_ids, sampling_params, priority=priority,
                       arrival_time=self.clock.now() if arrival_time is None else arrival_time,
                       slo=slo, index=index)
        spec = seq.sampling_params.structured_outputs
        if spec is not None:  # compiled (or found in the cache) before anything changes
            if self.structured is None:
                raise ValueError("structured_outputs needs the model's tokenizer.json and "
                                 "an executor that applies token masks")
            self.structured.check(spec)
        self.scheduler.add(seq, leader)  # validates; raises before any state changes
        if spec is not None:
            self.structured.add(seq.seq_id, spec)
        if self.trace is not None:
            self.trace.arrival(seq, seq.arrival_time)
        return seq.seq_id

    def resolve_slo(self, slo) -> SLO | None:
        """An SLO from what add_request accepts; raises ValueError for bad or unknown ones."""
        return request_slo(self.slo_classes, slo)

    def abort(self, request_id: int) -> bool:
        seq = self.scheduler.abort(request_id, now=self.clock.now())
        if seq is not None:
            self._aborted.append(seq)
            if self.structured is not None:
                self.structured.release(request_id)
            if self.trace is not None:
                self.trace.finish(seq, seq.finish_time)
            if seq.num_output_tokens:  # cut short (a stop string, a client gone) after its
                m = seq.metrics()     # first token: its objectives were met or missed
                self.slo_tracker.record(seq.slo, m.ttft, m.max_itl)
        return seq is not None

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached KV page, as vLLM's: only while no request holds a page
        (none running, none in flight); returns whether it did."""
        return self.scheduler.reset_prefix_cache()

    @property
    def limits(self) -> EngineLimits:
        """What the engine can ever take (core/served.py: the server's view of it)."""
        cfg = self.scheduler.config
        return EngineLimits(cfg.max_model_len, cfg.max_num_seqs, self.model_config.vocab_size)

    def queue_state(self) -> QueueState:
        """Admitted and waiting sequences (held samples count as waiting) and idle steps."""
        s = self.scheduler
        waiting = {seq.seq_id for seq in s.waiting}
        waiting.update(seq.seq_id for _, seq in s.held)
        return QueueState(len(s.running) + len(s.prefilling), frozenset(waiting),
                          s.stats()["iterations_idle"])

    def has_unfinished(self) -> bool:
        """True while a request is live, a step is in flight, or an abort is unreported."""
        return self.scheduler.has_unfinished() or self._inflight is not None or bool(self._aborted)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        compiles_before = compile_guard.compilations()
        try:
            return self._step()
        finally:
            self._compiles_while_serving += compile_guard.compilations() - compiles_before

    def _step(self) -> list[RequestOutput]:
        prev, self._inflight = self._inflight, None
        if prev is not None and not self.scheduler.can_plan_ahead():
            # The next plan may form a batch: this step only commits, so the caller can
            # add the requests that arrived meanwhile before it is made.
            return self._take_aborted(self._complete(prev))
        t0 = time.perf_counter()
        now = self.clock.now()
        plan = self.scheduler.schedule(now)
        predicted = None
        if plan.phase != "idle" and (self.trace is not None or self.clock.virtual):
            predicted = self.scheduler.latency.peek_plan(plan)
        if self.trace is not None:
            self.trace.plan(plan, now, predicted, self.scheduler)
        if self.config.data_parallel_size > 1 and plan.phase != "idle":
            self.scheduler.block_manager.count_rows(plan)
        handle = self.runner.dispatch(plan, prev) if plan.phase != "idle" else None
        if handle is not None:
            self.clock.dispatched(plan.step_id, predicted)
        t1 = time.perf_counter()
        host = t1 - t0
        outputs = []
        if prev is not None:  # planned and launched while `prev` ran; its commit runs
            self._counters["overlapped_host_seconds"] += host  # while `handle` computes
            self._counters["overlapped_steps"] += 1
            outputs = self._complete(prev, overlapped=handle is not None)
        if handle is None:
            self.scheduler.commit(plan, StepResult(), self.clock.now())
        elif self.config.async_scheduling:
            self._inflight = handle
        else:
            outputs += self._complete(handle)
        self._counters["host_seconds"] += host
        return self._take_aborted(outputs)

    def _complete(self, handle: StepHandle, overlapped: bool = False) -> list[RequestOutput]:
        """Waits for a dispatched step and commits it; one output per sampled token.
        `overlapped`: a later step is running, so the commit's host time is hidden."""
        t0 = time.perf_counter()
        result = handle.collect()
        t1 = result.collected_at
        plan = handle.plan
        self._count_expert_bytes(plan, result)
        # The step ran from its dispatch, or from the previous step's end if it queued
        # behind it, until now: an upper bound when the host collects late.
        start = max(result.dispatched_at, self._last_done)
        # A virtual clock keeps the estimator as loaded: wall times would bring the noise in.
        ran = self.clock.collected(plan.step_id)
        if ran is None:
            self.scheduler.observe(plan, t1 - start, sum(result.experts_activated))
            ran = start, t1
        self._last_done = t1
        # Sequences aborted (or, with overlap, finished) since schedule() drop their token.
        alive = [s for s in plan.sampling_seqs if not s.is_finished]
        # Where each one's new tokens start: its placeholder (then accepted drafts follow).
        first_new = {s.seq_id: s.num_tokens - s.num_pending_tokens for s in alive}
        now = self.clock.now()
        if self.trace is not None:
            self.trace.step_done(plan, t1 - start if result.collected_at else None, *ran)
        for seq in self.scheduler.commit(plan, result, now):
            m = seq.metrics()
            self.slo_tracker.record(seq.slo, m.ttft, m.max_itl)
            if self.trace is not None:
                self.trace.finish(seq, now)
        new = {s.seq_id: s.token_ids[first_new[s.seq_id]:] for s in alive}
        outputs = [self._output(s, new[s.seq_id]) for s in alive]
        if self.structured is not None and len(self.structured):
            for s in alive:  # each committed token joins its grammar's matcher
                if s.seq_id in self.structured:
                    for tok in new[s.seq_id]:
                        self.structured.advance(s.seq_id, tok)
                    if s.is_finished:
                        self.structured.release(s.seq_id)
        t2 = time.perf_counter()
        self._counters["device_seconds"] += t1 - t0
        self._counters["host_seconds"] += t2 - t1
        if overlapped:
            self._counters["overlapped_host_seconds"] += t2 - t1
        return outputs

    def _count_expert_bytes(self, plan: StepPlan, result: StepResult):
        per_expert = self.model_config.expert_bytes
        total = sum(result.experts_activated)
        self._counters["experts_activated"] += total
        self._counters["expert_bytes_loaded"] += total * per_expert
        if result.prefill_call is not None:
            bid = plan.prefill_batch_id
            self._batch_bytes[bid] = (self._batch_bytes.get(bid, 0)
                                      + result.prefill_experts * per_expert)
            while len(self._batch_bytes) > _KEEP_BATCHES:
                self._batch_bytes.popitem(last=False)

    def _take_aborted(self, outputs):
        """Adds one final output for each request aborted since the last step."""
        outputs += [self._output(seq, []) for seq in self._aborted]
        self._aborted.clear()
        return outputs

    def _output(self, seq: Sequence, new: list[int]) -> RequestOutput:
        return RequestOutput(seq, new, tokenizer=self.tokenizer)

    # ----------------------------------------------------------------- stats
    def stats(self) -> dict:
        s = dict(self.scheduler.stats())
        c = self._counters
        exposed = c["host_seconds"] - c["overlapped_host_seconds"]
        total = exposed + c["device_seconds"]
        s.update(
            programs=len(self.runner.programs),
            compile_seconds=round(self.runner.compile_seconds, 3),
            startup_compilations=self._startup_compilations,
            compilations_after_warmup=self._compiles_while_serving,
            row_layers_useful=self.runner.row_layers["useful"],
            row_layers_padded=self.runner.row_layers["padded"],
            padding_ratio=(self.runner.row_layers["padded"] / self.runner.row_layers["useful"]
                           if self.runner.row_layers["useful"] else 1.0),
            max_step_padding_ratio=self.runner.row_layers["max_step_ratio"],
            experts_activated=c["experts_activated"],  # summed over layers and steps
            expert_bytes_loaded=c["expert_bytes_loaded"],
            expert_bytes_per_prefill_batch=dict(self._batch_bytes),
            host_seconds=c["host_seconds"],
            overlapped_host_seconds=c["overlapped_host_seconds"],
            overlapped_steps=c["overlapped_steps"],
            device_seconds=c["device_seconds"],
            host_overhead_fraction=(exposed / total) if total else 0.0,
            kernel_backends={op: b for op, (b, _) in self.kernel_report.items()},
            kernel_fallbacks={op: e for op, (_, e) in self.kernel_report.items() if e},
            slo_attainment=self.slo_tracker.as_dict(),
            latency_model=self.scheduler.latency.error(),
            structured_outputs=({**self.structured.stats, "live": len(self.structured),
                                 **self.structured.compiler.stats}
                                if self.structured is not None else {}),
            free_pages=self.scheduler.block_manager.num_free_pages,
            total_pages=self.scheduler.config.num_pages,
        )
        if self.channel is not None and self.is_leader:
            s["plan_channel"] = self.channel.stats()
        if self.config.data_parallel_size > 1:  # per rank: dp_placement.balance
            s["data_parallel"] = self.scheduler.block_manager.balance()
        return s


def _load_tokenizer(model_dir):
    from pathlib import Path

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))
