"""launch/gpu_validate.py on the CPU: the smoke path runs every section end to end and
labels every figure; a deadline reached mid-run stops it at once and keeps what it had
finished; a kernel check that outlives its share is killed, what it had not finished is
"not run" (no verdict), and the run goes on. Every exit writes results.json with its
reason, the preflight first of all; the GPU path imports only what the H200 has.

The smoke run takes ~40-100 s on 2 idle cores (~7 min at load average 16: its budget is
set far out of reach, since it checks control flow, not speed), the deadline run ~10-20
s, the kill ~5 s.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CPU_O0_XLA_FLAGS

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "launch" / "gpu_validate.py"
SMOKE = "CPU smoke, not a measurement"
SECTIONS = ["kernels", "engine", "moe", "attention", "serving"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One compilation cache for the module: the later runs reuse the smoke run's programs."""
    return str(tmp_path_factory.mktemp("jax_cache"))


@pytest.fixture(scope="module")
def gv():
    return importlib.import_module("launch.gpu_validate")


def test_cpu_smoke_runs_every_section(tmp_path, cache_dir):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
    env["XLA_FLAGS"] = CPU_O0_XLA_FLAGS  # the smoke path compiles for the CPU only
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(out), "--cache-dir",
         cache_dir, "--budget-s", "2400"], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=2600)  # a budget a loaded 2-core host cannot run out of: control flow only
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    meta, secs = data["meta"], data["sections"]
    assert meta["smoke"] and meta["label"] == SMOKE and meta["step"] == "done"
    assert meta["exit"] == "done" and meta["preflight"]["versions"]["jax"] == "0.11.2"
    imported = set(meta["third_party_modules"])
    assert "grain" not in imported and imported <= _h200_modules(), imported - _h200_modules()
    assert list(secs) == SECTIONS
    for name, sec in secs.items():
        assert (sec["status"], sec["label"]) == ("ok", SMOKE), (name, sec)
    kernels = secs["kernels"]
    assert len(kernels["cases"]) == 2 and all(c["ok"] for c in kernels["cases"])
    assert all("layer 3 of 4" in c["case"] and c["compile_s"] > 0 for c in kernels["cases"])
    assert kernels["verdict"] == {"moe": True, "attention": True}
    assert meta["engine"]["buckets"] == [1, 3, 32, 259]  # only the measured ones
    assert sorted(b for c in meta["engine"]["compiles"] for b in c["buckets"]) == [1, 3, 32, 259]
    engine = secs["engine"]
    assert [r["batch"] for r in engine["decode"]] == [1, 3]
    assert all(r["ms_per_token"] > 0 for r in engine["decode"])
    assert [(r["mode"], r["tokens"]) for r in engine["prefill"]] == [
        ("chunked", 256), ("layered", 256), ("chunked", 128), ("layered", 256)]
    assert all(r["tokens_per_s"] > 0 and r["mj_per_token"] == "unavailable (no NVML)"
               for r in engine["prefill"])
    assert engine["layered_vs_chunked"]["expert_gb_ratio"] < 1
    assert "random" in engine["expert_bytes_note"]
    assert all(r["device_busy_ms"] > 0 for r in engine["trace"])
    assert (out / "trace_decode.xplane.pb").is_file()
    ops = {(r["op"], r["tokens"]) for r in secs["moe"]["rows"] if r["us"] > 0}
    assert ops == {(op, T) for op in ("moe_ffn[xla_tiles]", "ragged_dot") for T in (1, 32)}
    assert secs["moe"]["ragged_dot_mgpu_note"].startswith("not run")
    assert secs["attention"]["rows"][0]["gbps"] > 0
    serving = secs["serving"]
    assert serving["finished"] == 2 and serving["compiles_while_serving"] == 0
    md = (out / "results.md").read_text()
    assert SMOKE in md and "### serving: ok" in md and "| batch 1 |" in md


def test_a_deadline_stops_the_run_and_keeps_what_it_finished(gv, tmp_path, cache_dir,
                                                             monkeypatch):
    """The real sections under a clock that jumps to the deadline once the engine's first
    figure is saved: the run ends within seconds, that figure stays, the engine's other
    figures are listed as not reached and the later sections are skipped, each saying why."""
    clock = {"offset": 0.0, "jumped_at": None}

    def now():
        return time.perf_counter() + clock["offset"]

    save = gv.Validation.save

    def save_then_jump(run):
        save(run)
        if clock["jumped_at"] is None and run.data["sections"].get("engine", {}).get("decode"):
            clock["jumped_at"] = time.perf_counter()
            clock["offset"] += run.deadline - now()

    monkeypatch.setattr(gv.Validation, "save", save_then_jump)
    out = tmp_path / "out"
    data = gv.main(["--cpu-smoke", "--out", str(out), "--skip", "kernels", "--cache-dir",
                    cache_dir], clock=now)
    assert clock["jumped_at"] is not None
    assert time.perf_counter() - clock["jumped_at"] < 5.0
    secs = data["sections"]
    assert secs["kernels"] == {"status": "skipped", "label": SMOKE, "reason": "skipped: asked to"}
    engine = secs["engine"]
    assert engine["status"] == "partial"
    assert [r["figure"] for r in engine["decode"]] == ["batch 1"]
    assert engine["decode"][0]["ms_per_token"] > 0
    assert "prefill" not in engine and "trace" not in engine
    assert engine["not_reached"] and all("out of time" in r for r in engine["not_reached"])
    for name in ("moe", "attention", "serving"):
        assert secs[name]["status"] == "skipped"
        assert secs[name]["reason"].startswith("skipped: out of time")
    saved = json.loads((out / "results.json").read_text())
    assert {n: s["status"] for n, s in saved["sections"].items()} == {
        "kernels": "skipped", "engine": "partial", "moe": "skipped", "attention": "skipped",
        "serving": "skipped"}
    assert saved["meta"]["step"] == "done"
    md = (out / "results.md").read_text()
    assert "### engine: partial" in md and "| batch 1 |" in md and "### serving: skipped" in md


def test_a_kernel_check_past_its_share_is_killed_and_the_run_goes_on(gv, tmp_path):
    """A 20 s budget leaves the kernel checks ~3 s: the child is killed, nothing it did
    not finish counts as passed, and the run still ends and writes its results. The
    child gets a fresh compilation cache: with the default (~/.cache, kept between runs)
    a host that ran the checks before finished them inside the 3 s."""
    t = time.perf_counter()
    data = gv.main(["--cpu-smoke", "--out", str(tmp_path), "--budget-s", "20", "--skip",
                    "engine,moe,attention,serving", "--cache-dir", str(tmp_path / "cache")])
    assert time.perf_counter() - t < 15
    sec = data["sections"]["kernels"]
    assert sec["status"] == "partial" and "killed after" in sec["not_reached"][0]
    assert sec["verdict"] == {}  # nothing finished, so nothing failed: the engine checks
    assert len(sec["not_run"]) == 2 and all(c["status"] == "interrupted" for c in sec["cases"])
    assert json.loads((tmp_path / "results.json").read_text())["sections"]["kernels"] == sec


def test_kernel_verdicts_count_only_finished_cases(gv):
    planned = [("moe", "a"), ("attention", "b"), ("moe", "c")]
    ok = lambda op, case, good=True: {"op": op, "case": case, "status": "done", "ok": good}  # noqa: E731
    running = {"op": "moe", "case": "c", "status": "running"}
    assert gv.kernel_verdicts([ok("moe", "a"), ok("attention", "b"), ok("moe", "c")],
                              planned, killed=False) == ({"moe": True, "attention": True}, [])
    # killed in c: moe unchecked (not failed), attention passed
    verdict, not_run = gv.kernel_verdicts([ok("moe", "a"), ok("attention", "b"), running],
                                          planned, killed=True)
    assert verdict == {"attention": True} and not_run == ["c: interrupted by the kill"]
    # the child died in c by itself: that case failed
    assert gv.kernel_verdicts([ok("moe", "a"), ok("attention", "b"),
                               {**running, "status": "running"}], planned,
                              killed=False)[0] == {"moe": False, "attention": True}
    # a failure stands even if another case was not reached
    assert gv.kernel_verdicts([ok("moe", "a", False)], planned, killed=True) == (
        {"moe": False}, ["b: not reached", "c: not reached"])


def test_no_gpu_backend_still_writes_results_with_the_reason(gv, tmp_path):
    with pytest.raises(SystemExit) as e:
        gv.main(["--out", str(tmp_path)])
    assert e.value.code == 2
    meta = json.loads((tmp_path / "results.json").read_text())["meta"]
    assert meta["exit"].startswith("no GPU backend: jax.default_backend() is 'cpu'")
    pre = meta["preflight"]
    assert pre["backend"] == "cpu" and pre["python"] == sys.version.split()[0]
    assert set(pre["versions"]) >= {"jax", "jaxlib", "jax-cuda13-plugin", "flax",
                                    "orbax-checkpoint"}
    assert {"devices", "nvidia_smi", "ptxas", "hbm"} <= set(pre)
    assert (tmp_path / "results.md").is_file()


def test_preflight_is_on_disk_before_any_section_and_an_error_is_recorded(gv, tmp_path,
                                                                        monkeypatch):
    seen = {}

    def first_section(run, sections, skip):
        seen.update(json.loads((tmp_path / "results.json").read_text())["meta"])
        raise RuntimeError("a section blew up")

    monkeypatch.setattr(gv.Validation, "run", first_section)
    with pytest.raises(RuntimeError):
        gv.main(["--cpu-smoke", "--out", str(tmp_path)])
    assert "preflight" in seen and "exit" not in seen
    meta = json.loads((tmp_path / "results.json").read_text())["meta"]
    assert meta["exit"].startswith("RuntimeError: a section blew up")


def test_sigterm_writes_results_with_the_reason(gv, tmp_path, monkeypatch):
    """The device's timeout sends SIGTERM: the handler records it and exits."""
    import signal

    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr(gv.os, "_exit", exit_)
    monkeypatch.setattr(gv.Validation, "run",
                        lambda run, sections, skip: signal.raise_signal(signal.SIGTERM))
    with pytest.raises(SystemExit) as e:
        gv.main(["--cpu-smoke", "--out", str(tmp_path)])
    assert e.value.code == 128 + signal.SIGTERM
    meta = json.loads((tmp_path / "results.json").read_text())["meta"]
    assert meta["exit"].startswith(f"killed by signal {int(signal.SIGTERM)}")


def _h200_modules() -> set[str]:
    """Top-level modules the H200 machine can import: what the packages it has install,
    with everything they require (as installed here)."""
    import importlib.metadata as md
    import re

    have = ["jax", "jaxlib", "flax", "orbax-checkpoint", "tqdm", "rich", "prometheus-client",
            "nvidia-ml-py", "jax-cuda13-plugin", "jax-cuda13-pjrt"]
    seen, todo = set(), list(have)
    while todo:
        name = re.split(r"[\s;<>=!~\[(]", todo.pop())[0].lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo += [r for r in requires if "extra ==" not in r]
    # jax imports these where installed and goes on without them (try / except ImportError)
    optional_in_jax = {"cloudpickle", "filelock", "libtpu"}
    modules = {"jax_plugins", "pynvml", "nvidia", *optional_in_jax}  # nvidia: CUDA wheels
    for module, dists in md.packages_distributions().items():
        if any(d.lower().replace("_", "-") in seen for d in dists):
            modules.add(module)
    return modules
