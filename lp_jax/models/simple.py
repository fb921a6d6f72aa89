"""Single-sequence forward and greedy generation straight on the model.

No scheduler, no batching: a prompt is prefilled in one call and then decoded one
token at a time through a private paged KV cache. The golden-parity tests and the
engine's own tests use it as the plain reference for what the engine must produce.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lp_jax.models.backends import KernelBackends
from lp_jax.models.kv_cache import init_kv_cache
from lp_jax.models.metadata import build_metadata
from lp_jax.models.stacked import StackedCausalLM


@functools.partial(jax.jit, static_argnames=("graphdef", "decode_only", "backends"),
                   donate_argnames=("kv_pages",))
def _forward(graphdef, state, kv_pages, token_ids_T, meta, *, decode_only, backends):
    model = nnx.merge(graphdef, state)
    x_TD = model.embed(token_ids_T)
    L = model.config.num_hidden_layers
    x_TD, kv_pages, _ = model.run_layers(x_TD, kv_pages, meta, 0, L,
                                         decode_only=decode_only, backends=backends)
    return model.compute_logits(x_TD), kv_pages


def greedy_generate(model: StackedCausalLM, prompt: list[int], max_new_tokens: int, *,
                    page_size: int = 16, backends: KernelBackends = KernelBackends(),
                    return_prompt_logits: bool = False, num_pages: int | None = None,
                    prefill_rows: int | None = None):
    """Returns the greedy continuation (and the prompt's float32 logits if asked).
    `num_pages`: the KV pages to allocate (None: just enough); `prefill_rows`: the rows
    the prompt's call is padded to (None: the prompt's length; padding rows write no KV
    and their logits are dropped). Callers generating for several prompts pass one of
    each, so all their prefills share one program and all their decode steps another."""
    cfg = model.config
    total = len(prompt) + max_new_tokens
    need = math.ceil(total / page_size)
    if num_pages is None:
        num_pages = need
    elif num_pages < need:
        raise ValueError(f"{num_pages} pages cannot hold {total} tokens of {page_size}")
    rows = len(prompt) if prefill_rows is None else prefill_rows
    if rows < len(prompt):
        raise ValueError(f"a {len(prompt)}-token prompt exceeds prefill_rows={rows}")
    pages = list(range(num_pages))
    kv_pages = init_kv_cache(cfg, num_pages, page_size, model.dtype)
    graphdef, state = nnx.split(model)

    meta = build_metadata([(0, len(prompt), pages)], page_size=page_size,
                          num_tokens=rows, num_seqs=1, pages_per_seq=num_pages)
    token_ids = np.zeros(rows, np.int32)
    token_ids[:len(prompt)] = prompt
    logits, kv_pages = _forward(graphdef, state, kv_pages, jnp.asarray(token_ids), meta,
                                decode_only=False, backends=backends)
    prompt_logits = np.asarray(logits)[:len(prompt)]
    tokens = [int(np.argmax(prompt_logits[-1]))]
    for pos in range(len(prompt), total - 1):
        meta = build_metadata([(pos, 1, pages)], page_size=page_size, num_tokens=1, num_seqs=1,
                              pages_per_seq=num_pages)
        logits, kv_pages = _forward(graphdef, state, kv_pages,
                                    jnp.asarray([tokens[-1]], jnp.int32), meta,
                                    decode_only=True, backends=backends)
        tokens.append(int(np.argmax(np.asarray(logits)[0])))
    return (tokens, prompt_logits) if return_prompt_logits else tokens
