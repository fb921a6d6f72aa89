"""launch/gpu_validate.py on the CPU: the smoke path runs every section end to end and
writes a report in which each section has figures or says why not; the deadline skips
sections honestly; the KV-pool cap keeps a pool under 2**31 elements.

The end-to-end run uses the smallest settings (--quick, 2 layers; ~45 s on 2 cores).
The full smoke (`--cpu-smoke` alone, ~90 s) is run by hand before a GPU session.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "launch" / "gpu_validate.py"
SECTIONS = ("kernels", "moe", "steps", "serving")


def _run(out: Path, *args: str, timeout: int = 240) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"exit code {proc.returncode}\nstderr:\n{proc.stderr[-4000:]}"
                                  f"\nstdout:\n{proc.stdout[-2000:]}")
    assert (out / "results.md").is_file()
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def gv():
    spec = importlib.util.spec_from_file_location("gpu_validate", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def test_cpu_smoke_runs_every_section(tmp_path):
    data = _run(tmp_path, "--cpu-smoke", "--quick", "--layers", "2", "--budget-s", "200")
    meta = data["meta"]
    assert meta["smoke"] is True and meta["label"] == "CPU smoke, not a measurement"
    assert meta["current"] == "done" and "watchdog" not in meta
    secs = data["sections"]
    assert set(secs) == set(SECTIONS)
    for name, sec in secs.items():
        assert sec["status"] == "ok", (name, sec.get("reason"), sec.get("error"))
        assert sec["label"] == "CPU smoke, not a measurement"
    k = secs["kernels"]
    assert k["moe_gpu"] and all(r["ok"] for r in k["moe_gpu"] + k["attention_gpu"])
    assert any("pool_elements" in r for r in k["attention_gpu"])
    m = secs["moe"]
    ops = {r["op"] for r in m["rows"] if "best_ms" in r}
    assert {"moe_ffn[xla_tiles]", "ragged_dot", "moe_ffn[gpu] (interpret)",
            "moe_ffn[xla_tiles] per layer (8-layer loop)"} <= ops
    assert m["knee"]["knee_tokens"] >= 1 and "measured" in m["knee"]
    assert m["ragged_dot_mgpu"]["status"].startswith("lowered for an H200")
    assert "verdict" in m["ragged_dot_dense_check"]
    s = secs["steps"]
    assert [r["batch"] for r in s["decode"]] == [1, 4, 3]
    assert all(r["best_ms"] > 0 and r["bound_ms"] > 0 for r in s["decode"])
    modes = {r["mode"]: r for r in s["prefill"]}
    assert set(modes) == {"chunked", "layered", "chunked 4k", "layered 2x4k", "hybrid chunked",
                          "hybrid layered"}
    assert all("total_ms" in r for r in modes.values())
    assert modes["layered"]["iterations"] == 2  # G = min(4, 2 layers)
    assert modes["layered"]["expert_gb"] < modes["chunked"]["expert_gb"]
    runs = secs["serving"]["runs"]
    assert set(runs) == {"chunked", "layered"}
    for r in runs.values():
        assert r["requests_finished"] == 2 and r["ttft_mean_s"] > 0
        assert r["compiles_while_serving"] == 0  # everything compiled before serving
        assert r["energy"].startswith("not measured")
    assert {t["name"] for t in data["targets"]} >= {"decode batch 1, ms/token",
                                                    "moe_ffn 1 token, per layer"}
    assert all(t["met"] is None for t in data["targets"])  # never judged on a smoke run
    md = (tmp_path / "results.md").read_text()
    assert "CPU smoke, not a measurement" in md and "### 4. serving: ok" in md


def test_out_of_time_and_unselected_sections_are_recorded(tmp_path):
    data = _run(tmp_path, "--cpu-smoke", "--budget-s", "5", "--sections", "moe,steps",
                timeout=120)
    secs = data["sections"]
    assert secs["kernels"]["reason"] == "skipped: not selected (--sections)"
    assert secs["serving"]["status"] == "skipped"
    for name in ("moe", "steps"):
        assert secs[name]["status"] == "skipped"
        assert secs[name]["reason"].startswith("skipped: out of time")
    assert "skipped: out of time" in (tmp_path / "results.md").read_text()


def test_kv_pool_is_capped_when_the_big_pool_check_failed(gv):
    ctx = types.SimpleNamespace(scale=gv.H200, state={"big_pool_ok": False})
    L, S, elems = 48, 16, 16 * 8 * 128
    decode_ctx, pages = gv.page_plan(ctx, L, S, elems)
    assert pages * L * elems < 2**31
    used = max(B * -(-(c + 1) // S) for B, c in decode_ctx.items()) + 1
    used += -(-(8192 + 1) // S) + 2 * -(-(4096 + 1) // S)
    assert used <= pages and decode_ctx[1] == 2048 and decode_ctx[128] < 2048
    ctx.state["big_pool_ok"] = True
    decode_ctx, pages = gv.page_plan(ctx, L, S, elems)
    assert decode_ctx == {1: 2048, 32: 2048, 128: 2048, 10: 2560} and pages > 16384


def test_targets_are_judged_only_on_a_measurement(gv):
    ctx = types.SimpleNamespace(smoke=False, data={"targets": []})
    gv.add_target(ctx, "a", 2.0, 2.5, "<=", "ms")
    gv.add_target(ctx, "b", 2.0, 3.3, ">=", "TB/s")
    gv.add_target(ctx, "c", None, 1.0, ">=", "x")
    assert [t["met"] for t in ctx.data["targets"]] == [True, False, None]
    ctx.smoke = True
    gv.add_target(ctx, "a", 2.0, 2.5, "<=", "ms")
    assert [t["name"] for t in ctx.data["targets"]] == ["b", "c", "a"]
    assert ctx.data["targets"][-1]["met"] is None


def test_watchdog_ends_a_hung_run_and_keeps_the_results(gv, tmp_path, monkeypatch):
    args = types.SimpleNamespace(quick=False, budget_s=100.0, out=str(tmp_path), avoid="",
                                 hang_grace_s=0.0)
    ctx = gv.Ctx(args, smoke=False)
    ctx.finished, ctx.current_section, ctx.section_t0 = False, "moe", time.perf_counter()
    ctx.data["meta"]["current"] = "moe: moe_ffn[gpu] T=1"
    ctx.data["sections"].update(kernels={"status": "ok"}, moe={"status": "running"})
    ctx.section_deadline = time.perf_counter() - 1.0

    def fake_exit(code):
        raise SystemExit(code)

    monkeypatch.setattr(gv.os, "_exit", fake_exit)
    with pytest.raises(SystemExit):
        gv.watchdog(ctx)
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["sections"]["moe"]["status"] == "hung"
    assert data["sections"]["kernels"]["status"] == "ok"
    assert {data["sections"][s]["status"] for s in ("steps", "serving")} == {"skipped"}
    assert "moe_ffn[gpu] T=1" in data["meta"]["watchdog"]
    assert "watchdog: ended the run" in (tmp_path / "results.md").read_text()
