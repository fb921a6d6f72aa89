"""The `lp` command and the engine flags generated from EngineConfig (lp_jax/engine_args.py).

The flags are written once, in EngineConfig's field metadata: every spelling the
commands accepted before still parses to the same EngineConfig, `lp serve` with no flag
builds EngineConfig(), a new field with help becomes a flag of its own, `lp aot` keeps
its compile-only defaults and says so, and docs/engine_args.md is what the fields say.
"""

import dataclasses
import json
import tomllib
from pathlib import Path

import pytest

from lp_jax import cli, serve
from lp_jax.aot import __main__ as aot_cli
from lp_jax.engine.config import EngineConfig, engine_arg
from lp_jax.engine_args import add_engine_args, engine_flags, engine_kwargs, markdown
from lp_jax.paths import CACHE_ENV, cache_dir

ROOT = Path(__file__).resolve().parents[1]


def test_no_flags_give_the_engines_defaults(monkeypatch):
    monkeypatch.setenv(CACHE_ENV, "/nowhere/lp")
    assert serve.engine_config(serve.build_parser().parse_args([])) == EngineConfig()
    assert EngineConfig().compilation_cache_dir == "/nowhere/lp/jax_cache"


def test_every_spelling_parses_to_its_field(tmp_path):
    """The spellings of the hand-written parsers, and the values they gave."""
    latency = tmp_path / "latency.json"
    latency.write_text("{}")
    slo = {"chat": {"ttft_ms": 250, "tbt_ms": 100}}
    argv = ["--model", "m", "--scheduler-cls", "flowprefill", "--max-model-len", "128",
            "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--layer-groups", "3",
            "--max-layer-groups", "8", "--page-size", "8", "--no-enable-prefix-caching",
            "--kv-pages", "100", "--kv-memory-fraction", "0.3", "--load-format", "dummy",
            "--mesh-shape", "2,4", "--dtype", "float32", "-q", "int8",
            "--kv-cache-dtype", "fp8_e4m3", "--moe-backend", "xla",
            "--moe-dispatch", "all_to_all", "--attention-backend", "ref",
            "--backends", "strict", "--seed", "3", "--token-buckets", "16,4",
            "--no-warmup", "--no-async-scheduling", "--compilation-cache-dir", "",
            "--trace", "t.jsonl", "--slo-classes", json.dumps(slo), "--tbt-slo-ms", "50",
            "--adaptive-margin", "0.2", "--preemption-granularity", "layer",
            "--preemptible", "--slo-alpha", "0.3", "--flowprefill-rules", "lp_jax",
            "--flowprefill-lookahead", "2", "--max-paused-prefills", "0",
            "--latency-model", str(latency), "--prefill-only", "--num-processes", "2",
            "--process-id", "1", "--coordinator-address", "h:1", "--plan-channel", "device",
            "--follower-timeout-s", "5"]
    got = serve.engine_config(serve.build_parser().parse_args(argv))
    assert got == EngineConfig(
        model="m", scheduling="flowprefill", max_model_len=128, max_num_seqs=4,
        max_num_batched_tokens=64, layer_groups=3, max_layer_groups=8, page_size=8,
        enable_prefix_caching=False, kv_pages=100, kv_memory_fraction=0.3,
        load_format="dummy", mesh_shape=(2, 4), dtype="float32", quantization="int8",
        kv_cache_dtype="fp8_e4m3", moe_backend="xla", moe_dispatch="all_to_all",
        attention_backend="ref", backends="strict", seed=3, token_buckets=(4, 16),
        warmup=False, async_scheduling=False, compilation_cache_dir=None,
        trace_path="t.jsonl", slo_classes=slo, tbt_slo_ms=50.0, adaptive_margin=0.2,
        preemption_granularity="layer", preemptible=True, slo_alpha=0.3,
        flowprefill_rules="lp_jax", flowprefill_lookahead=2, max_paused_prefills=0,
        latency_model=str(latency), prefill_only=True, num_processes=2, process_id=1,
        coordinator_address="h:1", plan_channel="device", follower_timeout_s=5.0)
    again = serve.build_parser().parse_args(["--scheduling", "chunked", "--quantization",
                                             "fp8", "--trace-path", "u", "--warmup"])
    assert (again.scheduling, again.quantization, again.trace_path, again.warmup) == (
        "chunked", "fp8", "u", True)


@pytest.mark.parametrize("argv", [["--max-num-seqs", "0"], ["--kv-cache-dtype", "fp16"],
                                  ["--slo-alpha", "1.5"], ["--latency-model", "/no/such"],
                                  ["--token-buckets", "a,b"], ["-q", "int4"]])
def test_bad_flags_stop_with_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        serve.build_parser().parse_args(argv)
    assert e.value.code == 2 and argv[0] in capsys.readouterr().err


def test_each_field_is_a_flag_or_python_only():
    """A new field needs help metadata (a flag) or a place in this list (Python only)."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert fields - set(engine_flags()) == {"virtual_clock"}


def test_a_new_field_with_help_becomes_a_flag():
    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class Wider(EngineConfig):
        tensor_parallel_size: int = engine_arg(1, "devices a layer is split over",
                                         type="positive_int")
        no_flag: int = 7

    import argparse

    parser = argparse.ArgumentParser()
    names = add_engine_args(parser, config_cls=Wider)
    assert "tensor_parallel_size" in names and "no_flag" not in names
    args = parser.parse_args(["--tensor-parallel-size", "4", "--seed", "2"])
    cfg = Wider(**engine_kwargs(args, names, config_cls=Wider))
    assert (cfg.tensor_parallel_size, cfg.seed, cfg.no_flag) == (4, 2, 7)
    assert "| `tensor_parallel_size` | `--tensor-parallel-size` | 1 |" in markdown(Wider)
    with pytest.raises(SystemExit):
        parser.parse_args(["--tensor-parallel-size", "0"])


def test_aot_keeps_its_compile_defaults_and_says_so(capsys):
    base = ["--platform", "cuda", "--preset", "qwen3-8b", "--out", "x"]
    args = aot_cli.build_parser().parse_args(base)
    assert (args.max_model_len, args.mesh_shape, args.scheduling) == (4096, None, "layered")
    cfg = aot_cli.aot_config(args)
    assert (cfg.mesh_shape, cfg.max_model_len, cfg.max_num_seqs, cfg.token_buckets) == (
        (1, 1, 1), 4096, 32, None)
    for spelling in ("--mesh", "--mesh-shape"):
        args = aot_cli.build_parser().parse_args(base + [spelling, "2,4", "--token-buckets",
                                                         "8,64", "--scheduler-cls", "orca"])
        assert aot_cli._mesh(args) == (1, 2, 4)
        assert (args.token_buckets, args.scheduling) == ((8, 64), "orca")
    args = aot_cli.build_parser().parse_args(base + ["--kv-cache-dtype", "fp8", "-q", "int8",
                                                     "--max-paused-prefills", "2"])
    cfg = aot_cli.aot_config(args)
    assert (cfg.kv_cache_dtype, cfg.quantization, cfg.max_paused_prefills) == ("fp8", "int8", 2)
    with pytest.raises(SystemExit):
        aot_cli.build_parser().parse_args(base + ["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "[default here: 4096; the engine's: min(max_position_embeddings, 8192)]" in text
    assert "[default here: every device of the TPU slice" in text


def test_engine_args_doc_is_current():
    """After changing a field: lp engine-args --out docs/engine_args.md"""
    assert (ROOT / "docs/engine_args.md").read_text() == markdown()


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "lp_jax"
    assert EngineConfig().compilation_cache_dir == str(tmp_path / "lp_jax" / "jax_cache")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert cache_dir() == Path.home() / ".cache" / "lp_jax"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_lp_version_usage_and_unknown_command(capsys):
    from lp_jax.version import lp_jax_version

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"lp_jax {lp_jax_version()}\n"
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in cli.COMMANDS)
    assert cli.main(["nonsense"]) == 2
    assert "unknown command 'nonsense'" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_each_command_has_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([name, "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage: ")


def test_console_scripts_point_at_entry_points():
    """`lp` and the aliases lp-serve, lp-bench, lp-demo resolve to functions."""
    import importlib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"lp", "lp-serve", "lp-bench", "lp-demo"} <= set(scripts)
    for target in scripts.values():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func))
