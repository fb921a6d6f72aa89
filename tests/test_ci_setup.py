"""The suite's own set-up (tests/conftest.py): XLA:CPU programs compile at -O0, programs
for any other backend keep their compiler's defaults."""

import jax
import pytest
from conftest import _cpu_o0
from jax._src import compiler


@pytest.mark.skipif(not _cpu_o0, reason="LP_TEST_CPU_O0=0 asked for XLA's default level")
def test_cpu_programs_compile_at_o0_and_others_at_the_default():
    cpu = jax.devices("cpu")[0].client
    debug = compiler.get_compile_options(1, 1, backend=cpu).executable_build_options.debug_options
    assert (debug.xla_backend_optimization_level, debug.xla_llvm_disable_expensive_passes) == (
        0, True)
    other = compiler.get_compile_options(1, 1).executable_build_options.debug_options
    assert other.xla_backend_optimization_level != 0
    assert not other.xla_llvm_disable_expensive_passes
