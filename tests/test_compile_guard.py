"""The compile guard counts every program the warm-up did not hold, including one read
back from the persistent compilation cache the test run shares (conftest.py): a late
program is a bug whether or not some earlier build left it in the cache."""

import jax
import pytest
from jax._src import compilation_cache

from lp_jax import LLM, SamplingParams
from lp_jax.executor import compile_guard

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(engines):
    """A new engine (the test drops one of its programs) of the shared chunked shapes."""
    return LLM(**engines.kwargs("chunked"))


def test_the_run_shares_a_persistent_cache():
    assert jax.config.jax_compilation_cache_dir, "conftest.py sets one for the whole run"
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0


@pytest.mark.parametrize("cached", [True, False])
def test_a_late_program_counts_whether_or_not_the_cache_holds_it(llm, cached):
    """Drops the 16-row program the warm-up compiled (from the engine and from JAX's
    in-memory caches), then serves a prompt that needs it.
    With the cache on, the program comes back from disk (a cache hit, asserted, so the
    case is really the cached one); with it off, it compiles. Both count as a serving
    compilation."""
    runner = llm.engine.runner
    assert set(runner.programs) == {4, 16}
    del runner.programs[16]
    jax.clear_caches()  # nor does JAX's in-memory cache of compiled lowerings hold it
    before = llm.stats()["compilations_after_warmup"]
    hits = compile_guard.cache_hits()
    enabled = jax.config.jax_enable_compilation_cache
    # JAX decides once per process whether the persistent cache is used (memoized in
    # compilation_cache.is_cache_used); reset_cache makes it read the flag again.
    jax.config.update("jax_enable_compilation_cache", cached)
    compilation_cache.reset_cache()
    try:
        llm.generate(prompt_token_ids=[list(range(1, 12))], sampling_params=GREEDY)
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        compilation_cache.reset_cache()
    assert 16 in runner.programs
    assert (compile_guard.cache_hits() > hits) == cached
    assert llm.stats()["compilations_after_warmup"] > before


def test_a_warm_engine_serves_without_compiling(llm):
    """The control: once every bucket's program is held, serving adds no event."""
    before = compile_guard.compilations()
    llm.generate(prompt_token_ids=[[4, 5, 6], list(range(2, 16))], sampling_params=GREEDY)
    assert compile_guard.compilations() == before
