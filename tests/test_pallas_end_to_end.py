"""The model with each Pallas backend (interpret mode on CPU) reproduces the golden
Hugging Face greedy tokens. The TPU attention kernel needs head_dim % 128 == 0, so
the TPU backends run on the `tiny-h128` preset; the GPU and XLA ones on `tiny`; GPT-OSS
on `tiny-gpt-oss`."""

import numpy as np
import pytest

from checkpoints.make_tiny import ensure_tiny
from lp_jax.loader import load_model
from lp_jax.models import KernelBackends
from lp_jax.models.simple import greedy_generate
from pallas_kernels.moe import gpu as moe_gpu

NEW_TOKENS = 4  # interpret mode runs seconds per decode step on these models
# SMs the Mosaic GPU MoE kernel spreads its work items over in the interpreter (the H200's
# 132 by default on CPU): each simulated SM is a grid-loop iteration of every call, work
# or not (132 -> 8 took the gpu-MoE run from 69 to 44 s of CPU); 8 still leave SMs
# with several work items.
INTERPRET_SMS = 8


# (preset, moe, attention, golden prompt, page size)
CASES = [
    ("tiny-h128", "tpu", "tpu", 1, 16),
    # 40 tokens: five full pages of 8, so the first decode token opens a sixth page
    ("tiny", "gpu", "gpu", 2, 8),
    ("tiny", "xla", "xla", 1, 16),
    # GPT-OSS (sinks, 8-key windows over a 17-token prompt, expert biases, clamped
    # SwiGLU): TPU MoE kernel, GPU attention kernels (the TPU attention kernel's head_dim
    # 64 case is tested in test_attention_kernels.py; this tiny model's is 16)
    ("tiny-gpt-oss", "tpu", "gpu", 1, 16),
]


def _rel_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(b)))


@pytest.mark.parametrize("preset,moe,attention,prompt_index,page_size", CASES)
def test_pallas_backends_match_golden_and_xla(monkeypatch, preset, moe, attention,
                                              prompt_index, page_size):
    """The model's own calls (jit, the layer loop, layer page offsets, a prefill then
    decode-only steps) through the kernels in interpret mode: the golden greedy tokens,
    and the prompt's float32 logits within 1e-5 of the xla backends' (this merges the
    former tiny-model tests of test_moe_kernels.py and test_attention_kernels.py)."""
    monkeypatch.setenv("LP_JAX_PALLAS_INTERPRET", "1")
    monkeypatch.setattr(moe_gpu, "_num_sms", lambda: INTERPRET_SMS)
    golden = np.load(f"tests/golden/{preset}.npz")
    prompt = golden[f"prompt_{prompt_index}"].tolist()
    want = golden[f"greedy_{prompt_index}"].tolist()
    model = load_model(ensure_tiny(preset=preset))
    tokens, logits = greedy_generate(model, prompt, NEW_TOKENS, page_size=page_size,
                                     backends=KernelBackends(moe=moe, attention=attention),
                                     return_prompt_logits=True)
    assert tokens == want[:NEW_TOKENS]
    if moe != "xla" or attention != "xla":
        _, ref_logits = greedy_generate(model, prompt, 1, page_size=page_size,
                                        return_prompt_logits=True)
        err = _rel_err(logits, ref_logits)
        assert err < 1e-5, err


def test_engine_with_tpu_kernels_matches_xla(monkeypatch):
    """The serving engine (layered prefill: ragged batches mixing prefill chunks and
    decode tokens over several sequences) serving with both TPU kernels in interpret
    mode gives the plain XLA model's greedy tokens, and frees every page. The start-up
    self-test is off (test_kernel_check.py runs it on this model's kernels): a fallback
    to xla could not then pass unseen, and stats() shows the kernels that served."""
    from lp_jax import LLM, SamplingParams

    monkeypatch.setenv("LP_JAX_PALLAS_INTERPRET", "1")
    path = ensure_tiny(preset="tiny-h128")
    rng = np.random.default_rng(3)
    # a prompt over the 32-token budget (two batches), one over a page, short ones; the
    # interpreter's cost follows the rows (a 64-token budget took twice as long). One row
    # bucket: each interpret-mode program takes ~25 s of CPU to compile, and the padding
    # rows of decode steps cost little (they route to no expert and open no query item).
    prompts = [rng.integers(0, 509, n).tolist() for n in (5, 40, 20, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm = LLM(model=str(path), scheduling="layered", layer_groups=2, max_num_seqs=4,
              max_model_len=128, max_num_batched_tokens=32, token_buckets=(36,),
              moe_backend="tpu", attention_backend="tpu", backends="off", log=None)
    assert llm.stats()["kernel_backends"] == {"moe": "tpu", "attention": "tpu"}
    eng = llm.engine
    ids = {eng.add_request(p, params): i for i, p in enumerate(prompts[:2])}
    outs, step = {}, 0
    while len(outs) < len(prompts):
        if step == 2:  # later arrivals join running decodes and a half-done prefill
            ids.update({eng.add_request(p, params): i + 2 for i, p in enumerate(prompts[2:])})
        for out in eng.step():
            if out.finished:
                outs[ids[out.request_id]] = out.token_ids
        step += 1
    assert eng.stats()["free_pages"] == eng.stats()["total_pages"]
    model = load_model(path)
    for i, p in enumerate(prompts):  # one prefill and one decode program for the four
        assert outs[i] == greedy_generate(model, p, 3, num_pages=3, prefill_rows=40), i
