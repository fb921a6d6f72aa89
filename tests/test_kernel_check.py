"""The start-up self-test of the Pallas kernels, and the fallback when one fails.

CPU stands in for the device: the kernels run in the Pallas interpreter, and a failure
is simulated by breaking a kernel (wrong numbers, or an exception like a compile error).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.make_tiny import ensure_tiny
from lp_jax.config import ModelConfig
from lp_jax.executor.kernel_check import KernelCheckError, check_backends, model_experts
from lp_jax.models.backends import KernelBackends
from pallas_kernels.attention import tpu as attention_tpu
from pallas_kernels.moe import tpu as moe_tpu


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.from_pretrained(ensure_tiny(preset="tiny-h128"))


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("LP_JAX_PALLAS_INTERPRET", "1")


def _wrong_moe(real):
    def broken(*args, **kwargs):
        y, stats = real(*args, **kwargs)
        return y * 1.5, stats
    return broken


def _failing_attention(*args, **kwargs):
    raise RuntimeError("Mosaic: offsets along tiled dimensions must be aligned (simulated)")


def test_working_kernels_pass_and_are_kept(cfg, interpret, tiny_model):
    logs = []
    chosen, report = check_backends(cfg, KernelBackends(moe="tpu", attention="tpu"),
                                    jnp.float32, page_size=16, log=logs.append,
                                    experts=model_experts(tiny_model))
    assert (chosen.moe, chosen.attention) == ("tpu", "tpu")
    assert report == {"moe": ("tpu", None), "attention": ("tpu", None)} and not logs


def test_the_moe_check_reads_the_last_layer_of_the_loaded_experts(cfg, interpret,
                                                                  tiny_model):
    """The engine's check runs on its own weights, at the stack's last layer (where a
    stride that overflows at full depth would show): NaN there fails it; NaN in the
    first layer, which it does not read, leaves it passing."""
    w_gate_up, w_down, biases, quant = model_experts(tiny_model)
    assert quant == {}
    L = w_gate_up.shape[0]
    assert L > 1
    backends = KernelBackends(moe="tpu", attention="xla")
    for layer, passes in ((L - 1, False), (0, True)):
        poisoned = (w_gate_up.at[layer].set(jnp.nan), w_down, biases, quant)
        chosen, report = check_backends(cfg, backends, jnp.float32, page_size=16,
                                        log=lambda *_: None, experts=poisoned)
        assert (chosen.moe == "tpu") is passes, (layer, report)


def test_a_wrong_or_failing_kernel_falls_back_with_one_warning(cfg, interpret, monkeypatch):
    monkeypatch.setattr(moe_tpu, "moe_ffn_tpu", _wrong_moe(moe_tpu.moe_ffn_tpu))
    monkeypatch.setattr(attention_tpu, "ragged_paged_attention", _failing_attention)
    logs = []
    chosen, report = check_backends(cfg, KernelBackends(moe="tpu", attention="tpu"),
                                    jnp.float32, page_size=16, log=logs.append)
    assert (chosen.moe, chosen.attention) == ("xla_tiles", "xla")
    assert "relative error" in report["moe"][1] and "Mosaic" in report["attention"][1]
    assert len(logs) == 2 and all(m.startswith("WARNING") for m in logs)
    assert "'tpu'" in logs[0] and "xla_tiles" in logs[0]


def test_strict_turns_the_fallback_into_an_error(cfg, interpret, monkeypatch):
    monkeypatch.setattr(moe_tpu, "moe_ffn_tpu", _wrong_moe(moe_tpu.moe_ffn_tpu))
    with pytest.raises(KernelCheckError, match="moe backend 'tpu' failed"):
        check_backends(cfg, KernelBackends(moe="tpu", attention="xla"), jnp.float32,
                       page_size=16, mode="strict")


def test_xla_backends_need_no_check(cfg, monkeypatch):
    monkeypatch.setattr(moe_tpu, "moe_ffn_tpu", _failing_attention)  # never called
    chosen, report = check_backends(cfg, KernelBackends(), jnp.float32, page_size=16)
    assert (chosen.moe, chosen.attention) == ("xla_tiles", "xla")  # "auto" on CPU


def test_engine_serves_with_the_fallback_and_reports_it(interpret, monkeypatch, engines,
                                                        tiny_model):
    """A broken MoE kernel at start-up: the engine serves with xla_tiles, gives the plain
    model's tokens, and says so in stats() and /metrics. The engine has the shared chunked
    engine's configuration on the tiny model (whose experts have tiny-h128's shapes, so
    the MoE check runs the program the tests above compiled): in a full run its programs
    are the shared engine's, from the run's compilation cache."""
    from lp_jax import LLM, SamplingParams
    from lp_jax.models.simple import greedy_generate
    from lp_jax.server.metrics import ServerMetrics

    monkeypatch.setattr(moe_tpu, "moe_ffn_tpu", _wrong_moe(moe_tpu.moe_ffn_tpu))
    llm = LLM(**engines.kwargs("chunked"), moe_backend="tpu", attention_backend="xla")
    s = llm.stats()
    assert s["kernel_backends"] == {"moe": "xla_tiles", "attention": "xla"}
    assert set(s["kernel_fallbacks"]) == {"moe"}
    prompt = np.random.default_rng(0).integers(0, 509, 20).tolist()
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert out.token_ids == greedy_generate(tiny_model, prompt, 4)
    metrics = ServerMetrics("tiny")
    metrics.update_from_engine(llm.stats(), running=0, waiting=0)
    assert 'lp:kernel_backend_info{model_name="tiny",op="moe",backend="xla_tiles"} 1' in \
        metrics.render()


def test_the_moe_check_runs_quantized_experts_with_their_scales(interpret, monkeypatch):
    """An int8 model's check runs the kernel on the stored int8 stack and its scales (not
    a 16-bit stand-in): it passes, and a kernel that drops the scales fails it."""
    from lp_jax.loader import load_model

    model = load_model(ensure_tiny(preset="tiny-h128"), quantization="int8")
    experts = model_experts(model)
    assert experts[0].dtype == jnp.int8 and set(experts[3]) == {"scales", "scheme"}
    backends = KernelBackends(moe="tpu", attention="xla")
    chosen, report = check_backends(model.config, backends, jnp.float32, page_size=16,
                                    log=lambda *_: None, experts=experts)
    assert chosen.moe == "tpu", report
    real = moe_tpu.moe_ffn_tpu

    def drops_scales(*args, scales=None, **kwargs):
        return real(*args, scales=tuple(jnp.ones_like(s) for s in scales), **kwargs)

    monkeypatch.setattr(moe_tpu, "moe_ffn_tpu", drops_scales)
    chosen, report = check_backends(model.config, backends, jnp.float32, page_size=16,
                                    log=lambda *_: None, experts=experts)
    assert chosen.moe == "xla_tiles" and "relative error" in report["moe"][1]
