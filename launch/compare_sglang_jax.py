"""lp_jax and sglang-jax compiled for the same TPU slice, side by side, per device.

    python launch/compare_sglang_jax.py --sglang-jax-src PATH   # a clone or a snapshot

One command, top to bottom:
1. sglang-jax's source at the pinned commit: `--sglang-jax-src` (a git clone or bare git
   directory, from which the pinned commit is archived; or an unpacked snapshot whose
   commit the caller vouches for), else a clone from GitHub.
2. Its own venv (`.cache/sglang_jax_venv/<commit>`), with sglang-jax installed from that
   source with its pinned dependencies (jax[tpu] and flax) from PyPI.
3. sglang-jax's Qwen3-30B-A3B model and sampler programs, compiled in that venv for the
   slice by `launch/sglang_jax_compile.py` at 1 and 2 decoder layers.
4. lp_jax's programs for the same shapes and layer counts (`python -m lp_jax.aot`).
5. `lp_jax/bench/compare_sglang_jax.py` reads both, prints the table and writes
   OUT/table.md.

Layouts: attention tensor-parallel over the 8 chips, experts expert-parallel over the
same 8 (lp_jax `--tensor-parallel-size 8 --enable-expert-parallel`; sglang-jax
`--tp-size 8 --ep-size 8`); one KV pool of max-num-seqs x max-model-len tokens in both.
Needs PyPI for sglang-jax's pins, so it is not part of CI; it takes tens of minutes on a
small host.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SGLANG_JAX_REPO = "https://github.com/sgl-project/sglang-jax"
SGLANG_JAX_COMMIT = "cddbf6f1cc33cbdd453bd8f36ff7051cf46ca176"  # 2026-08-21
CONFIG = ROOT / "checkpoints" / "configs" / "Qwen3-30B-A3B.json"


def run(cmd, **kw):
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def source(src: str | None, cache: Path) -> Path:
    """sglang-jax's `python/` directory at the pinned commit."""
    dest = cache / f"sglang_jax_src/{SGLANG_JAX_COMMIT[:12]}"
    if (dest / "python" / "pyproject.toml").exists():
        return dest / "python"
    if src is None:
        clone = cache / "sglang_jax_git"
        try:
            if not clone.exists():
                run(["git", "clone", "--quiet", "--bare", SGLANG_JAX_REPO, clone])
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"cannot clone {SGLANG_JAX_REPO} ({e}); pass --sglang-jax-src "
                             "with a clone or snapshot of it") from e
        src = str(clone)
    path = Path(src)
    if (path / "python" / "pyproject.toml").exists() and not _is_git(path):
        print(f"using the unpacked snapshot {path}; it must be sglang-jax {SGLANG_JAX_COMMIT}")
        return path / "python"
    if not _is_git(path):
        raise SystemExit(f"--sglang-jax-src {path}: neither a git directory nor a snapshot "
                         "with python/pyproject.toml")
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(suffix=".tar") as tar:
        try:
            run(["git", f"--git-dir={_git_dir(path)}", "archive", "-o", tar.name,
                 SGLANG_JAX_COMMIT, "python"])
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"{path} lacks sglang-jax commit {SGLANG_JAX_COMMIT}: fetch it, "
                             "or update SGLANG_JAX_COMMIT here and recheck the harness") from e
        with tarfile.open(tar.name) as t:
            t.extractall(dest, filter="data")
    return dest / "python"


def _git_dir(path: Path) -> Path:
    return path / ".git" if (path / ".git").exists() else path


def _is_git(path: Path) -> bool:
    return (path / ".git").exists() or (path / "HEAD").exists() and (path / "objects").is_dir()


def venv(src: Path, cache: Path) -> Path:
    """The venv's python, sglang-jax and its pins installed (once per commit)."""
    env_dir = cache / f"sglang_jax_venv/{SGLANG_JAX_COMMIT[:12]}"
    python, done = env_dir / "bin" / "python", env_dir / ".installed"
    if done.exists():
        return python
    run([Path(sys.base_prefix) / "bin" / "python3", "-m", "venv", env_dir])
    env = dict(os.environ, SETUPTOOLS_SCM_PRETEND_VERSION=f"0.0.0+g{SGLANG_JAX_COMMIT[:8]}")
    run([python, "-m", "pip", "install", "-q", f"{src}[tpu]"], env=env)
    done.write_text(SGLANG_JAX_COMMIT)
    return python


def model_dir(out: Path, layers: int | None = None) -> Path:
    """A directory with Qwen3-30B-A3B's config.json (`layers` decoder layers)."""
    cfg = json.loads(CONFIG.read_text())
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    d = out / ("model" if layers is None else f"model_{layers}L")
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return d


def compile_sglang(python: Path, args, out: Path) -> None:
    env = dict(os.environ, PYTHONPATH="")
    run([python, ROOT / "launch" / "sglang_jax_compile.py", "--model-dir", model_dir(out),
         "--topology", args.topology, "--tp", args.tp, "--ep", args.tp,
         "--decode", args.decode, "--prefill", args.prefill, "--max-seqs", args.max_num_seqs,
         "--max-model-len", args.max_model_len, "--page-size", args.page_size,
         "--kv-tokens", args.max_num_seqs * args.max_model_len, "--out", out / "sglang"],
        env=env)


def compile_lp_jax(args, out: Path, layers: int) -> Path:
    dest = out / f"lp_jax_{layers}L"
    rows = [*args.decode.split(","), str(args.prefill)]
    # the layered policy's budget sized so that the largest bucket is the prefill
    budget = args.prefill - args.max_num_seqs
    if (dest / "summary.json").exists():
        return dest
    # exit status 1 is an audit violation: the programs are written all the same
    cmd = [sys.executable, "-m", "lp_jax.aot", "--platform", "tpu", "--topology", args.topology,
           "--config", model_dir(out, layers), "--tensor-parallel-size", args.tp,
           "--enable-expert-parallel", "--max-num-seqs", args.max_num_seqs,
           "--max-model-len", args.max_model_len, "--page-size", args.page_size,
           "--max-num-batched-tokens", budget, "--token-buckets", ",".join(rows),
           "--jobs", "1", "--out", dest]
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if not (dest / "summary.json").exists():
        raise SystemExit(f"python -m lp_jax.aot wrote no {dest}/summary.json")
    return dest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sglang-jax-src", default=None,
                   help="a clone (or bare git directory) of sglang-jax holding the pinned "
                        "commit, or an unpacked snapshot of it; default: clone from GitHub")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "compare_sglang_jax")
    p.add_argument("--cache", type=Path, default=ROOT / ".cache")
    p.add_argument("--topology", default="v6e:2x4")
    p.add_argument("--tp", type=int, default=8, help="attention TP = experts EP = chips")
    p.add_argument("--decode", default="8,64,128", help="decode batch sizes")
    p.add_argument("--prefill", type=int, default=512, help="prefill tokens")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--skip-sglang", action="store_true", help="reuse OUT/sglang")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if not args.skip_sglang:
        python = venv(source(args.sglang_jax_src, args.cache), args.cache)
        compile_sglang(python, args, args.out)
    lp_dirs = {n: compile_lp_jax(args, args.out, n) for n in (1, 2)}

    from lp_jax.bench import compare_sglang_jax as csj
    from lp_jax.roofline.hardware import get_hardware
    from lp_jax.roofline.model_shape import ModelShape

    compiles = csj.load_lp_jax(lp_dirs) + csj.load_sglang(args.out / "sglang")
    hw = get_hardware(args.topology.split(":")[0])
    sg = json.loads((args.out / "sglang" / "summary.json").read_text())
    lp = json.loads((lp_dirs[1] / "summary.json").read_text())
    _, ep, tp = lp["config"]["mesh_shape"]
    rows = csj.compare(compiles, ModelShape.from_json(CONFIG), hw,
                       max_model_len=args.max_model_len, page_size=args.page_size, tp=tp, ep=ep)
    head = (f"Qwen3-30B-A3B compiled for {args.topology} on this host; sglang-jax "
            f"{SGLANG_JAX_COMMIT[:12]} (jax {sg['jax']}), lp_jax (jax {lp['jax']}); KV pool "
            f"tokens: lp_jax {lp['kv_tokens']:,}, sglang-jax {sg['max_total_num_tokens']:,}")
    table = head + "\n" + csj.render(rows) + "\n"
    (args.out / "table.md").write_text(table)
    print(table)
    print(f"wrote {args.out}/table.md in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
