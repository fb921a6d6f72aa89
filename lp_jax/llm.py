"""The offline API, shaped like vLLM's: `LLM(model, ...).generate(prompts, params)`."""

from __future__ import annotations

from lp_jax.core.sampling_params import SamplingParams
from lp_jax.engine.config import EngineConfig
from lp_jax.engine.llm_engine import LLMEngine
from lp_jax.engine.outputs import RequestOutput


class LLM:
    """With several processes (`num_processes=...`, or LP_* variables; see
    engine/distributed.py) every process runs the same script: on process 0, the leader,
    LLM works as usual; on a follower, the constructor runs the leader's steps until the
    leader calls `shutdown()` or exits, and `generate` then returns []."""

    def __init__(self, model: str | None = None, **engine_args):
        """`engine_args`: EngineConfig's fields, and `log` (print) and `executor` (None:
        the model's own; see LLMEngine)."""
        log = engine_args.pop("log", print)
        executor = engine_args.pop("executor", None)
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_args), log=log,
                                executor=executor)
        if not self.engine.is_leader:
            self.engine.serve_follower()

    @property
    def is_leader(self) -> bool:
        return self.engine.is_leader

    def shutdown(self):
        """Releases the followers of a multi-process engine (also done at exit)."""
        self.engine.shutdown()

    def generate(self, prompts: list[str] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 prompt_token_ids: list[list[int]] | None = None,
                 slos=None) -> list[RequestOutput]:
        """Runs the requests to completion; outputs come back in input order.

        Exactly one of `prompts` (text; needs a tokenizer) and `prompt_token_ids`.
        `slos`: one latency objective for all prompts or a list, one per prompt (an `SLO`,
        a class name, or a dict of slo_class / ttft_slo_ms / tbt_slo_ms; None: none).
        A request that fails validation raises before any request is queued.
        With `n` > 1, a prompt's samples run as n requests (the later ones take the
        prompt's pages from the prefix cache); its RequestOutput is the first sample's,
        and `.outputs` lists all n.
        """
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompts and prompt_token_ids")
        if not self.is_leader:
            return []  # a follower ran its steps in the constructor
        inputs = list(prompts if prompts is not None else prompt_token_ids)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(inputs):
                raise ValueError(
                    f"{len(sampling_params)} sampling params for {len(inputs)} prompts")
            params = sampling_params
        else:
            params = [sampling_params or SamplingParams()] * len(inputs)
        if isinstance(slos, list):
            if len(slos) != len(inputs):
                raise ValueError(f"{len(slos)} slos for {len(inputs)} prompts")
        else:
            slos = [slos] * len(inputs)
        groups, added = [], []  # per prompt: the request ids of its samples
        try:
            for prompt, p, slo in zip(inputs, params, slos, strict=True):
                if not isinstance(p, SamplingParams):
                    raise ValueError(f"sampling_params must be SamplingParams, got {p!r}")
                group = []
                for sample in p.samples():
                    group.append(self.engine.add_request(
                        prompt, sample, slo=slo, prefill_after=group[0] if group else None,
                        index=len(group)))
                    added.append(group[-1])
                groups.append(group)
        except ValueError:
            for rid in added:  # all or nothing
                self.engine.abort(rid)
            while self.engine.has_unfinished():
                self.engine.step()
            raise
        done: dict[int, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        results = []
        for group in groups:
            first = done[group[0]]
            if len(group) > 1:
                first.samples = [done[i] for i in group]
            results.append(first)
        return results

    def stats(self) -> dict:
        return self.engine.stats()
