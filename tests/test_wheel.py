"""The wheel works outside the repository (setup.py, lp_jax/paths.py).

One test: `python -m build` makes the wheel; it is installed with --no-deps into a fresh
venv that sees this environment's packages (JAX and the rest) but not the checkout; then,
from a directory outside the repository, `lp serve` (LLMEngine behind the HTTP server)
answers a completion. The venv's site-packages reaches this environment's through a .pth file of
plain paths: `venv --system-site-packages` run from a venv would show the base
interpreter's packages, not this venv's. The .pth files in those directories (an
editable install of lp_jax among them) are not run, so the checkout stays unreachable.

The model is the tiny preset the suite already builds (the demo model costs a minute of
training); the default model's pieces the wheel must carry are checked instead: its
fables file, and a training stamp equal to the checkout's, so that a checkout and an
install sharing one cache directory share one trained model.
"""

import ast
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest
from conftest import CPU_O0_XLA_FLAGS

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The cache holds"

CHECKS = """
import importlib.util, json, sys
import lp_jax
from lp_jax.checkpoints import train_demo
from lp_jax.pallas_kernels.compile_targets import _TARGETS_DIR
from lp_jax.paths import models_dir
from lp_jax.roofline.model_shape import CONFIG_DIR
from lp_jax.sim.workload import AZURE_CONV_CSV

assert lp_jax.__file__.startswith(sys.prefix), lp_jax.__file__
for d in (_TARGETS_DIR, CONFIG_DIR, AZURE_CONV_CSV):  # data the code finds beside itself
    assert d.exists() and str(d).startswith(sys.prefix), d
assert [n for n in ("checkpoints", "pallas_kernels") if importlib.util.find_spec(n)] == []
print(json.dumps({"fables": len(train_demo.read_fables()), "stamp": train_demo._stamp(),
                  "models": str(models_dir())}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _wait_healthy(url: str, proc, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"lp serve exited {proc.returncode}:\n{proc.stdout.read()}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("lp serve did not answer /health in time")


def test_wheel_installs_and_serves_outside_the_repository(tmp_path, tiny_dir):
    if importlib.util.find_spec("build") is None:
        pytest.fail("python -m build is not installed: pip install -e '.[dev]'")
    from checkpoints import train_demo

    dist = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation",
                        "--outdir", str(dist), str(ROOT)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (wheel,) = dist.glob("lp_jax-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    dist_info = wheel.name.split("-py3")[0] + ".dist-info"
    assert {n.split("/")[0] for n in names} == {"lp_jax", dist_info}
    assert zipfile.ZipFile(wheel).read(f"{dist_info}/top_level.txt") == b"lp_jax\n"
    top = set()
    with zipfile.ZipFile(wheel) as z:
        for node in (node for f in names if f.endswith(".py")
                     for node in ast.walk(ast.parse(z.read(f)))):
            if isinstance(node, ast.Import):
                top |= {n.name.split(".")[0] for n in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                top.add(node.module.split(".")[0])
    assert not top & {"checkpoints", "pallas_kernels"}  # every import re-rooted
    for data in ("lp_jax/checkpoints/data/aesop_townsend.txt",
                 "lp_jax/checkpoints/configs/Qwen3-30B-A3B.json",
                 "lp_jax/sim/data/compiled/qwen_h200.json", "lp_jax/sim/data/splitwise_conv.csv",
                 "lp_jax/aot/gpu_targets/h200.txtpb", "lp_jax/pallas_kernels/moe/__init__.py"):
        assert data in names, data

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    py = venv / "bin" / "python"
    site_dir = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                               "['purelib'])"], capture_output=True, text=True,
                              check=True).stdout.strip()
    here = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    Path(site_dir, "outer_env.pth").write_text("\n".join(here) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # lp serve compiles for the CPU only: at the suite's XLA:CPU level (conftest)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {CPU_O0_XLA_FLAGS}".strip()
    # --ignore-installed: never touch the lp_jax this environment may hold (editable).
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                        "--ignore-installed",
                        str(wheel)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    lp, port = venv / "bin" / "lp", _free_port()
    proc = subprocess.Popen(
        [str(lp), "serve", "--model", str(tiny_dir), "--port", str(port),
         "--max-model-len", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
         "--token-buckets", "68", "--disable-log-stats"],
        cwd=outside, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        r = subprocess.run([str(py), "-c", CHECKS], cwd=outside, env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-5000:]
        got = json.loads(r.stdout.strip().splitlines()[-1])
        assert got["fables"] == len(train_demo.read_fables())
        assert got["stamp"] == train_demo._stamp()  # the checkout's demo model is the wheel's
        assert got["models"] == os.path.join(os.environ["LP_JAX_CACHE_DIR"], "models")
        version = subprocess.run([str(lp), "--version"], cwd=outside, env=env,
                                 capture_output=True, text=True, timeout=120)
        assert version.stdout.startswith("lp_jax "), version.stderr

        base = f"http://127.0.0.1:{port}"
        _wait_healthy(f"{base}/health", proc)
        answer = _post(f"{base}/v1/completions", {
            "model": tiny_dir.name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True})
        assert answer["usage"]["completion_tokens"] == 8 and answer["choices"][0]["text"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, proc.stdout.read()[-3000:]
