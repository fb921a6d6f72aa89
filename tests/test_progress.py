"""Start-up progress and the serving stats line (lp_jax/progress.py), host only."""

import re

from lp_jax.progress import Progress, StatsLine


def test_progress_lines_count_and_estimate():
    lines = []
    p = Progress(3, "programs", lines.append, every_s=0.0, bar=False)
    for _ in range(3):
        p.advance()
    p.close()
    assert [re.match(r"compiled (\d)/3 programs, [0-9.]+ s", s).group(1) for s in lines] == \
        ["1", "2", "3"]
    assert all("left" in s for s in lines[:2]) and "left" not in lines[2]


def test_progress_throttles_but_always_reports_the_end():
    lines = []
    p = Progress(50, "programs", lines.append, every_s=3600.0, bar=False)
    for _ in range(50):
        p.advance()
    assert lines == [lines[-1]] and lines[-1].startswith("compiled 50/50 programs")
    silent = Progress(5, "programs", None, bar=False)
    silent.advance(5)  # no log: nothing to call
    assert silent.done == 5


def test_stats_line_rates_over_the_interval():
    base = dict(prefill_tokens=100, decode_tokens=10, prefix_cache_queries=50,
                prefix_cache_hits=0, preemptions=1, free_pages=64, total_pages=64)
    line = StatsLine(base, now=0.0)
    later = dict(base, prefill_tokens=600, decode_tokens=210, prefix_cache_queries=150,
                 prefix_cache_hits=25, preemptions=2, free_pages=48)
    text = line(later, running=3, waiting=2, now=10.0)
    assert text == ("prompt throughput: 50.0 tokens/s, generation throughput: 20.0 tokens/s, "
                    "running: 3 reqs, waiting: 2 reqs, KV cache usage: 25.0%, prefix cache "
                    "hit rate: 25.0%, preemptions: 2")
    idle = line(later, running=0, waiting=0, now=20.0)  # nothing new: zero rates
    assert "prompt throughput: 0.0" in idle and "hit rate: 0.0%" in idle


def test_no_tpu_noise_on_a_machine_without_one():
    """libtpu is installed here (the tests' `tpu` extra) and no TPU is attached: the engine
    names the CPU backend itself, so start-up prints no TPU-discovery warnings. Without
    that, `jax.devices()` alone writes several lines about the TPU to stderr."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    code = ("from lp_jax.backend_select import skip_absent_tpu\n"
            "print(skip_absent_tpu())\nimport jax\nprint(jax.devices()[0].platform)\n")
    quiet = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=120)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.split() == ["cpu", "cpu"] and "tpu" not in quiet.stderr.lower(), quiet
    noisy = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert "tpu" in noisy.stderr.lower(), "the check above proves nothing if JAX is quiet"
