"""The executor: turns a `StepPlan` into one compiled device step.

One step function serves every policy. For a plan whose prefill chunks run through
layers [a, b) it does, in one program:

    decode rows : embed -> layers [0, a) ------+                +-> layers [b, L) -> logits
                                               |                |
    prefill rows: embed (a == 0) or carried ---+-> layers [a, b)+-> carried hidden (b < L)
                  hidden states (a > 0)          (both row sets)     or logits (b == L)

so the designated group reads each MoE layer's experts once for prefill and decode
together, and all other layers see decode rows only. Orca and chunked plans are the
case a = 0, b = L; a decode-only plan has no prefill rows.

Programs are specialised per layer group and compiled ahead of time into
`self.programs`, keyed by (group start, group size, prefill bucket, decode bucket).
A group's *size* is always static. Its start is static for the first group (which
embeds the prompt), the last (which samples) and whole-stack plans; for a middle
group of a model whose layers are all of one kind the start is a runtime scalar,
so every middle group of a size shares one program (key start None). Without that,
layered prefill with G up to 16 would compile sum(G) ~ 136 range variants per
bucket pair. Reachable programs:

    decode-only:  one per decode bucket
    with prefill: for each prefill bucket, for each group count G reachable with a
                  token count in that bucket, the distinct keys of the G groups of
                  split_layers(L, G), each with every decode bucket and with none.

Orca and chunked reach a single range (0, L). `warmup()` compiles all of them; the
persistent compilation cache makes restarts cheap. The KV pool is donated to every
step, so its update is in place.

`dispatch(plan, prev)` launches a step without waiting for it and returns a
`StepHandle`; `collect(handle)` waits for its tokens. Every program returns its
sampled tokens in one fixed-size array, and every decode program takes the previous
step's array plus a row per decode: a decode whose last token is still a placeholder
(its step was planned before the step sampling that token was committed; see
scheduler.py) reads it on device from `prev`, so the engine can plan and dispatch
step k+1 while step k runs, with no host round trip for the token.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lp_jax.engine.layer_groups import num_layer_groups, split_layers
from lp_jax.engine.plan import StepPlan
from lp_jax.engine.sampler import sample
from lp_jax.models.metadata import build_decode_metadata, build_metadata
from lp_jax.models.qwen3_moe import KernelBackends, Qwen3MoeForCausalLM, init_kv_cache
from lp_jax.sharding import named_sharding, replicated

_MIN_BUCKET = 16


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two from lo up to hi, with hi itself as the last bucket."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return (*out, hi)


@dataclasses.dataclass(frozen=True)
class StepHandle:
    """A dispatched step: its plan, the device arrays it will fill, and where each
    sampling sequence's token sits in `tokens_R`."""

    plan: StepPlan
    tokens_R: jax.Array | None
    counts: list
    rows: dict[int, int]  # seq_id -> row of tokens_R


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest compiled bucket {buckets[-1]}")


class ModelRunner:
    def __init__(self, model: Qwen3MoeForCausalLM, *, mesh, num_pages: int, page_size: int,
                 max_model_len: int, max_num_seqs: int, max_prefill_tokens: int,
                 policy: str, layer_groups, max_layer_groups: int,
                 backends: KernelBackends, seed: int = 0,
                 prefill_buckets=None, decode_buckets=None):
        self.cfg = model.config
        self.dtype = model.dtype
        self.uniform = model.uniform_layers
        self.L = self.cfg.num_hidden_layers
        self.graphdef, self.state = nnx.split(model)
        self.page_size = page_size
        self.pages_per_seq = math.ceil(max_model_len / page_size)
        self.policy, self.layer_groups = policy, layer_groups
        self.max_layer_groups = max_layer_groups
        self.backends = backends
        self.seed = seed
        self.decode_buckets = decode_buckets or pow2_buckets(1, max_num_seqs)
        self.prefill_buckets = prefill_buckets or pow2_buckets(
            min(_MIN_BUCKET, max_prefill_tokens), max_prefill_tokens)
        self.max_prefill_seqs = max_num_seqs
        if self.prefill_buckets[-1] < max_prefill_tokens:
            raise ValueError(f"prefill_buckets {self.prefill_buckets} must reach the "
                             f"{max_prefill_tokens} prefill tokens a plan may hold")
        if self.decode_buckets[-1] < max_num_seqs:
            raise ValueError(f"decode_buckets {self.decode_buckets} must reach "
                             f"max_num_seqs={max_num_seqs}")
        kv_shape_axes = ("kv_pages", None, "kv_combined_heads", None)
        kv_shape = (self.L * num_pages, page_size, 2 * self.cfg.num_key_value_heads,
                    self.cfg.head_dim)
        self.kv_pages = init_kv_cache(self.cfg, num_pages, page_size, model.dtype,
                                      sharding=named_sharding(kv_shape_axes, kv_shape, mesh))
        # Sampled tokens of any program, padded to one size: decode rows, then prefill rows.
        self.num_token_rows = self.decode_buckets[-1] + self.max_prefill_seqs
        self._token_sharding = replicated(mesh)
        self._no_prev_tokens = jax.device_put(np.zeros(self.num_token_rows, np.int32),
                                              self._token_sharding)
        self.programs: dict[tuple, jax.stages.Compiled] = {}
        self.compile_seconds = 0.0
        self.hidden: dict[int, jax.Array] = {}  # layered batch id -> prefill hidden states

    # ------------------------------------------------------------ programs
    def program_key(self, a: int, b: int, T: int, B: int) -> tuple:
        """(static start or None, size, T, B) for prefill rows in layers [a, b)."""
        static = a == 0 or b == self.L or not self.uniform
        return (a if static else None, b - a, T, B)

    def reachable_keys(self) -> list[tuple]:
        """Every program key a plan can map to."""
        keys = [(0, 0, 0, B) for B in self.decode_buckets]
        prev = 0
        for T in self.prefill_buckets:
            if self.policy == "layered":
                gs = sorted({num_layer_groups(n, self.layer_groups,
                                              max_layer_groups=self.max_layer_groups,
                                              num_layers=self.L)
                             for n in (prev + 1, T)})
                gs = range(gs[0], gs[-1] + 1)
                ranges = sorted({r for g in gs for r in split_layers(self.L, g)})
            else:
                ranges = [(0, self.L)]
            for a, b in ranges:
                keys += [self.program_key(a, b, T, B) for B in (0, *self.decode_buckets)]
            prev = T
        return list(dict.fromkeys(keys))

    def warmup(self, log=print):
        keys = self.reachable_keys()
        t0 = time.perf_counter()
        for key in keys:
            self._program(key)
        if log:
            log(f"compiled {len(keys)} programs in {time.perf_counter() - t0:.1f} s")

    def _program(self, key):
        prog = self.programs.get(key)
        if prog is None:
            a, size, T, B = key
            t0 = time.perf_counter()
            fn = jax.jit(functools.partial(self._step, a=a, size=size, T=T, B=B),
                         donate_argnums=(1,))
            a_ex = 1 if a is None else a  # any middle start will do: it is traced
            example = self._inputs(T, B, a_ex, a_ex + size, [], [], [], traced_start=a is None)
            prog = fn.lower(self.state, self.kv_pages, example).compile()
            self.compile_seconds += time.perf_counter() - t0
            self.programs[key] = prog
        return prog

    # ----------------------------------------------------------- the step
    def _step(self, state, kv_pages, inputs, *, a, size, T, B):
        model = nnx.merge(self.graphdef, state)
        L, D = self.L, self.cfg.hidden_size
        first = a == 0
        last = a is not None and a + size == L
        if a is None:
            a = inputs["layer_start"]
        b = a + size
        backends = self.backends
        counts = []
        if B:
            dec_meta = inputs["dec_meta"]
            prev_B = inputs["dec_prev_rows"]  # -1: the token is in dec_tokens
            tokens_B = jnp.where(prev_B >= 0, inputs["prev_tokens"][jnp.maximum(prev_B, 0)],
                                 inputs["dec_tokens"])
            x_dec = model.embed(tokens_B)
            x_dec, kv_pages, c = model.run_layers(x_dec, kv_pages, dec_meta, 0, a,
                                                  decode_only=True, backends=backends)
            counts.append(c)
        out = {}
        if T:
            x_pre = model.embed(inputs["pre_tokens"]) if first else inputs["hidden"]
            if B:
                x_mix = jnp.zeros((T + B, D), x_pre.dtype)
                x_mix = x_mix.at[inputs["pre_rows"]].set(x_pre, mode="drop")
                x_mix = x_mix.at[inputs["dec_rows"]].set(x_dec, mode="drop")
            else:
                x_mix = x_pre
            x_mix, kv_pages, c = model.run_layers(x_mix, kv_pages, inputs["mix_meta"], a, b,
                                                  backends=backends)
            counts.append(c)
            if B:
                x_pre = x_mix[jnp.minimum(inputs["pre_rows"], T + B - 1)]
                x_dec = x_mix[inputs["dec_rows"]]
            else:
                x_pre = x_mix
            if not last:
                out["hidden"] = x_pre
        if B:
            x_dec, kv_pages, c = model.run_layers(x_dec, kv_pages, dec_meta, b if T else 0, L,
                                                  decode_only=True, backends=backends)
            counts.append(c)
        rows = []
        if B:
            rows.append(model.compute_logits(x_dec))
        if T and last:
            rows.append(model.compute_logits(x_pre[inputs["sample_rows"]]))
        if rows:
            s = inputs["sampling"]
            tokens = sample(jnp.concatenate(rows), s["temperature"], s["top_k"],
                            s["top_p"], s["seed"], s["position"])
            tokens = jnp.pad(tokens, (0, self.num_token_rows - tokens.shape[0]))
            out["tokens"] = jax.lax.with_sharding_constraint(tokens, self._token_sharding)
        out["experts_activated"] = counts
        return kv_pages, out

    # ------------------------------------------------------- host inputs
    def _inputs(self, T, B, a, b, decode, chunks, sample_chunks, hidden=None, *,
                traced_start=False, prev: StepHandle | None = None):
        """numpy inputs for the step; `decode`: seqs, `chunks`: (seq, start, end);
        `prev`: the uncommitted step whose tokens placeholder-ending decodes read."""
        S, C, Bp = self.page_size, self.pages_per_seq, min(self.max_prefill_seqs, max(T, 1))
        inputs = {}
        if traced_start:
            inputs["layer_start"] = np.int32(a)
        sampling_rows = []
        if B:
            inputs["dec_meta"] = build_decode_metadata(
                [s.num_tokens - 1 for s in decode], [s.page_ids for s in decode],
                page_size=S, num_seqs=B, pages_per_seq=C)
            toks = np.zeros(B, np.int32)
            prev_rows = np.full(B, -1, np.int32)
            for i, s in enumerate(decode):
                if s.num_pending_tokens:
                    prev_rows[i] = prev.rows[s.seq_id]
                else:
                    toks[i] = s.last_token
            inputs["dec_tokens"] = toks
            inputs["dec_prev_rows"] = prev_rows
            inputs["prev_tokens"] = prev.tokens_R if prev is not None else self._no_prev_tokens
            sampling_rows += [(s, s.num_tokens) for s in decode] + [None] * (B - len(decode))
        if T:
            pre = [(start, end - start, s.page_ids) for s, start, end in chunks]
            n_pre = sum(end - start for _, start, end in chunks)
            if B:
                mix = pre + [(s.num_tokens - 1, 1, s.page_ids) for s in decode]
                rows = np.full(T, T + B, np.int32)  # padding rows: out of range, dropped
                rows[:n_pre] = np.arange(n_pre)
                inputs["pre_rows"] = rows
                dec_rows = np.full(B, T + B - 1, np.int32)
                dec_rows[: len(decode)] = n_pre + np.arange(len(decode))
                inputs["dec_rows"] = dec_rows
            else:
                mix = pre
            inputs["mix_meta"] = build_metadata(mix, page_size=S, num_tokens=T + B,
                                                num_seqs=Bp + B, pages_per_seq=C)
            if a == 0:
                toks = np.zeros(T, np.int32)
                offset = 0
                for s, start, end in chunks:
                    toks[offset : offset + end - start] = s.token_ids[start:end]
                    offset += end - start
                inputs["pre_tokens"] = toks
            else:
                inputs["hidden"] = (hidden if hidden is not None else
                                    jnp.zeros((T, self.cfg.hidden_size), self.dtype))
            if b == self.L:
                sample_rows = np.zeros(Bp, np.int32)
                offset, j = 0, 0
                for s, start, end in chunks:
                    offset += end - start
                    if (s, start, end) in sample_chunks:
                        sample_rows[j] = offset - 1
                        j += 1
                inputs["sample_rows"] = sample_rows
                sampling_rows += [(s, s.num_tokens) for s, _, _ in sample_chunks]
                sampling_rows += [None] * (Bp - len(sample_chunks))
        if sampling_rows:
            inputs["sampling"] = self._sampling_inputs(sampling_rows)
        return inputs

    def _sampling_inputs(self, rows):
        n = len(rows)
        temperature = np.zeros(n, np.float32)
        top_k = np.zeros(n, np.int32)
        top_p = np.ones(n, np.float32)
        seed = np.zeros(n, np.int32)
        position = np.zeros(n, np.int32)
        for i, row in enumerate(rows):
            if row is None:
                continue
            seq, pos = row
            p = seq.sampling_params
            # top_k past the vocabulary is no limit at all (and may not fit int32).
            top_k[i] = p.top_k if 0 < p.top_k < self.cfg.vocab_size else 0
            temperature[i], top_p[i] = p.temperature, p.top_p
            # Unseeded requests draw from a stream fixed by the engine seed and request id.
            seed[i] = (p.seed if p.seed is not None else hash((self.seed, seq.seq_id))) & 0x7FFFFFFF
            position[i] = pos
        return {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed,
                "position": position}

    # ------------------------------------------------------------ execute
    def execute(self, plan: StepPlan):
        """Runs the plan and waits for it: `collect(dispatch(plan))`."""
        return self.collect(self.dispatch(plan))

    def dispatch(self, plan: StepPlan, prev: StepHandle | None = None) -> StepHandle:
        """Launches the plan's step and returns without waiting for the device. `prev`:
        the dispatched, uncommitted step whose tokens this plan's placeholders stand for."""
        # plan.preempted needs nothing here: device state is per layered batch, and the
        # scheduler never preempts a member of the batch in flight.
        decode = list(plan.decode)
        chunks = [(c.seq, c.start, c.end) for c in plan.prefill]
        sample_chunks = ([(c.seq, c.start, c.end) for c in plan.prefill if c.samples]
                         if plan.is_last_group else [])
        B = bucket_for(len(decode), self.decode_buckets) if decode else 0
        T = bucket_for(plan.num_prefill_tokens, self.prefill_buckets) if chunks else 0
        a, b = (plan.layer_start, plan.layer_end) if chunks else (0, 0)
        hidden = None
        if chunks and a > 0:
            hidden = self.hidden.pop(plan.prefill_batch_id)
        key = self.program_key(a, b, T, B)
        inputs = self._inputs(T, B, a, b, decode, chunks, sample_chunks, hidden,
                              traced_start=key[0] is None, prev=prev)
        prog = self._program(key)
        self.kv_pages, out = prog(self.state, self.kv_pages, inputs)
        if "hidden" in out:
            self.hidden[plan.prefill_batch_id] = out["hidden"]
        rows = {s.seq_id: i for i, s in enumerate(decode)}
        rows.update({s.seq_id: B + j for j, (s, _, _) in enumerate(sample_chunks)})
        return StepHandle(plan, out.get("tokens"), out["experts_activated"], rows)

    def collect(self, handle: StepHandle):
        """Waits for a dispatched step. Returns ({seq_id: token} for the plan's sampling
        sequences, experts activated in each layer span the step ran (decode [0, a),
        prefill+decode [a, b), decode [b, L), those present))."""
        sampled = {}
        if handle.tokens_R is not None:
            tokens = np.asarray(handle.tokens_R)
            sampled = {sid: int(tokens[r]) for sid, r in handle.rows.items()}
        counts = [int(c) for c in handle.counts]
        return sampled, counts
