"""The demo model's trainer (checkpoints/train_demo.py): the engine reads what it trained.

A few steps of the real training path on a smaller shape, written to tmp_path, then
served by the engine: its greedy tokens and its log-probabilities, of the prompt and of
each generated token, must be those of the trainer's own forward. A tensor written
under the wrong name or in the wrong layout (gate and up swapped, a missed transpose, a
router of another layer) changes them.
"""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from checkpoints import train_demo
from lp_jax import LLM, SamplingParams

# Two layers as the demo model, narrower, fewer experts and a smaller vocabulary.
ARCH = train_demo.Arch(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, experts=4,
                       top_k=2, expert_width=16, vocab=512)
RECIPE = train_demo.Recipe(steps=12, batch=4, context=32, warmup=3, fast_compile=True)
PROMPT = "The North Wind and the Sun disputed as to which"
NEW = 12
TOL = 2e-4


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "model"
    return train_demo.write_demo_dir(out, arch=ARCH, recipe=RECIPE, log=None)


def test_training_lowers_the_loss_and_writes_a_qwen3_moe_dir(trained):
    out, params, losses = trained
    assert len(losses) == RECIPE.steps and all(np.isfinite(losses))
    assert np.mean(losses[-3:]) < losses[0] - 0.5, losses
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["max_position_embeddings"] == 512
    assert (cfg["num_hidden_layers"], cfg["num_experts"], cfg["vocab_size"]) == (2, 4, 512)
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["model.layers.1.mlp.experts.3.down_proj.weight"].shape == (64, 16)
    info = json.loads((out / train_demo.INFO_FILE).read_text())
    assert info["parameters"] == sum(t.size for t in tensors.values())
    assert info["final_loss"] == round(losses[-1], 4)


def test_engine_greedy_tokens_and_logprobs_equal_the_trainers(trained):
    out, params, _ = trained
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    prompt = tok.encode(PROMPT).ids
    want = train_demo.greedy(params, ARCH, prompt, NEW)
    assert len(set(want)) > 1, want  # a constant continuation would prove little

    llm = LLM(str(out), scheduling="chunked", max_model_len=64, max_num_seqs=2,
              max_num_batched_tokens=32, token_buckets=(32,), log=None)  # one program
    res = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=1, prompt_logprobs=1))[0]
    assert res.token_ids == want

    ref = train_demo.log_probs(params, ARCH, prompt + want)  # the trainer's forward
    n = len(prompt)
    got_prompt = [res.prompt_logprobs[t][prompt[t]] for t in range(1, n)]
    np.testing.assert_allclose(got_prompt, ref[np.arange(n - 1), prompt[1:]], atol=TOL)
    got_new = [d[t] for d, t in zip(res.logprobs, want, strict=True)]
    np.testing.assert_allclose(got_new, ref[np.arange(n - 1, n - 1 + NEW), want], atol=TOL)
