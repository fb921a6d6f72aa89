"""The suite's own set-up (tests/conftest.py): XLA:CPU programs compile at -O0, programs
for any other backend keep their compiler's defaults; xdist runs the files longest first;
what collection built is frozen out of the garbage collector's walks."""

import gc
import types

import jax
import pytest
from conftest import GC_THRESHOLD_GEN0, _cpu_o0
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



class _Worker:
    """What xdist's scheduler sees of a worker: its id, and the test indices it is sent."""

    def __init__(self, name):
        self.gateway, self.sent, self.shutting_down = types.SimpleNamespace(id=name), [], False

    def send_runtest_some(self, indices):
        self.sent.append(indices)

    def shutdown(self):
        self.shutting_down = True


def test_xdist_hands_out_files_in_the_collected_order(request, monkeypatch):
    """xdist's loadfile schedule would hand out the files with the most tests first; the
    suite turns that off, so the files go out as collected: conftest's SLOWEST_FIRST."""
    xdist_scheduler = pytest.importorskip("xdist.scheduler")
    assert request.config.getoption("loadscopereorder") is False
    # two workers, as `make test` asks (`-n 2`), whether or not this run has any
    monkeypatch.setattr(xdist_scheduler.loadscope, "parse_tx_spec_config", lambda _: ["popen"] * 2)
    sched = xdist_scheduler.LoadFileScheduling(request.config)
    workers = [_Worker("gw0"), _Worker("gw1")]
    # a one-test file collected first, then files of three tests and two
    collected = ["tests/a.py::t", "tests/b.py::t1", "tests/b.py::t2", "tests/b.py::t3",
                 "tests/c.py::t1", "tests/c.py::t2"]
    for w in workers:
        sched.add_node(w)
    for w in workers:
        sched.add_node_collection(w, collected)
    sched.schedule()
    assert [w.sent[0] for w in workers] == [[0], [1, 2, 3]]


def test_collected_objects_are_frozen_and_a_full_collection_is_cheap():
    """The run's modules (collected before any test) sit in the collector's permanent
    generation: a full collection walks only what the tests made since."""
    assert gc.get_freeze_count() > 50_000  # JAX alone is more
    assert len(gc.get_objects()) < gc.get_freeze_count()


def test_the_youngest_generation_is_collected_less_often():
    assert gc.get_threshold()[0] == GC_THRESHOLD_GEN0 > 700  # Python's default is 700
