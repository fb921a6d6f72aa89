"""A user's own scheduling policy (docs/custom_policy.md's example, run from the doc's own
code) through the API, the server, the AOT sizing and the simulator (issue #29)."""

import re
import sys

import numpy as np
import pytest
from conftest import start_server

from lp_jax.core.policies import POLICIES, ChunkedPolicy, resolve_policy
from lp_jax.core.programs import step_buckets

DOC = "docs/custom_policy.md"
SPEC = "spf_policy:ShortestPromptFirst"


@pytest.fixture(scope="module")
def spf_module(tmp_path_factory):
    """docs/custom_policy.md's code block, saved as spf_policy.py on sys.path."""
    text = open(DOC).read()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    where = tmp_path_factory.mktemp("plugin")
    (where / "spf_policy.py").write_text(code)
    sys.path.insert(0, str(where))
    yield resolve_policy(SPEC)
    sys.path.remove(str(where))
    sys.modules.pop("spf_policy", None)


def test_the_example_is_about_50_lines_and_documented():
    code = re.search(r"```python\n(.*?)```", open(DOC).read(), re.S).group(1)
    assert 30 <= len(code.splitlines()) <= 60


def test_resolve_policy_forms_and_errors(spf_module):
    assert resolve_policy("chunked") is ChunkedPolicy is resolve_policy(ChunkedPolicy)
    assert resolve_policy("spf_policy.ShortestPromptFirst") is spf_module  # vLLM's form
    assert resolve_policy("lp_jax.core.policies.chunked:ChunkedPolicy") is ChunkedPolicy
    assert set(POLICIES) == {"orca", "chunked", "layered", "flowprefill"}
    for bad, says in [("fifo", "unknown scheduling policy 'fifo'"),
                      ("no_such_module:X", "cannot import 'no_such_module'"),
                      ("spf_policy:Nope", "has no 'Nope'"),
                      ("spf_policy:PrefillChunk", "not a subclass"),
                      ("re:compile", "not a Policy class"), (3, "got 3"), (dict, "not a subclass")]:
        with pytest.raises(ValueError, match=re.escape(says)):
            resolve_policy(bad)


def test_the_policy_declares_its_program_shape(spf_module):
    """decodes_in_budget: its largest step is its budget, so AOT and the engine size it as
    chunked prefill; a config it cannot run fails before anything compiles."""
    from lp_jax.aot import AotConfig, load_config, scheduler_config

    model = load_config("qwen3-30b-a3b")
    own = scheduler_config(model, AotConfig(platform="tpu", scheduling=SPEC), 1)
    chunked = scheduler_config(model, AotConfig(platform="tpu", scheduling="chunked"), 1)
    assert own.max_num_batched_tokens == 512 and own.name == "shortest-prompt-first"
    assert step_buckets(own) == step_buckets(chunked) and step_buckets(own)[-1] == 512
    with pytest.raises(ValueError, match="must hold every decode"):
        scheduler_config(model, AotConfig(platform="tpu", scheduling=SPEC,
                                          max_num_batched_tokens=8), 1)


@pytest.fixture(scope="module")
def spf_llm(spf_module, engines):
    """The shared chunked engine's arguments (so its programs come from the run's cache)
    with the example policy."""
    from lp_jax import LLM

    lines = []
    llm = LLM(**engines.kwargs("chunked") | {"scheduling": SPEC, "log": lines.append})
    llm.lines = lines
    return llm


def test_engine_serves_the_example_policy(spf_llm, engines):
    """Shortest prompt first: with three prompts arriving together, the first tokens come
    in prompt-length order (FCFS chunked prefill gives the first arrival's first), and
    every request's greedy tokens equal the chunked engine's."""
    from lp_jax import SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 500, n).tolist() for n in (40, 5, 20)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = spf_llm.generate(prompt_token_ids=prompts, sampling_params=params)
    want = engines("chunked").generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    first = [o.metrics.first_token_time for o in outs]
    assert first[1] < first[2] < first[0], first
    stats = spf_llm.stats()
    assert stats["programs"] == 2 and stats["compilations_after_warmup"] == 0
    assert "policy shortest-prompt-first" in spf_llm.lines[-1], spf_llm.lines[-1]
    assert stats["free_pages"] == stats["total_pages"]


def test_server_takes_the_policy_path(spf_llm, spf_module):
    """lp-serve's --scheduling (and vLLM's --scheduler-cls) take package.module:Class; a
    bad one stops lp-serve with the reason before anything loads; the engine serves."""
    import json
    import urllib.request

    from lp_jax.serve import build_parser, engine_config, main

    for flag in ("--scheduling", "--scheduler-cls"):
        args = build_parser().parse_args([flag, SPEC])
        assert resolve_policy(engine_config(args).scheduling) is spf_module
    with pytest.raises(SystemExit, match="cannot import 'nope'"):
        main(["--scheduling", "nope:Policy"])
    server = start_server(spf_llm.engine)
    try:
        body = json.dumps({"model": "mock", "prompt": [1, 2, 3], "max_tokens": 3,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"{server.url}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.load(r)
        assert out["choices"][0]["finish_reason"] == "length"
        assert out["usage"]["completion_tokens"] == 3
    finally:
        server.stop()


def test_simulator_runs_the_example_policy(spf_module):
    """The simulator takes the same class: on mixed prompt lengths arriving together,
    shortest-first finishes every request, with a lower mean TTFT than FCFS chunked."""
    from lp_jax.roofline import QWEN3_30B_A3B, get_hardware
    from lp_jax.sim import Request, SimConfig, Simulator

    reqs = [Request(0.0, n, 8) for n in (3000, 200, 1500, 50, 800, 100)]
    runs = {}
    for policy in (SPEC, "chunked"):
        cfg = SimConfig(shape=QWEN3_30B_A3B, hardware=get_hardware("H100"), policy=policy,
                        tp=2, max_num_seqs=16, max_model_len=4096)
        runs[policy] = Simulator(cfg).run(reqs)
    for r in runs.values():
        assert all(m.num_tokens == 8 for m in r.metrics)
    ttft = {p: np.mean([m.ttft for m in r.metrics]) for p, r in runs.items()}
    assert ttft[SPEC] < ttft["chunked"], ttft
