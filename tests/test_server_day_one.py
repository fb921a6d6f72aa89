"""What a vLLM user looks for on day one, against the JAX-free MockEngine over real HTTP:
--version and /version, /ping, /tokenize and /detokenize in vLLM's shapes, --chat-template,
the vllm: metric names, the Grafana dashboard's metrics, and pyproject's SPDX license."""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from conftest import start_server

import lp_jax
from lp_jax.serve import build_parser
from lp_jax.server.chat import read_template_file
from lp_jax.server.metrics import VLLM_NAMES
from lp_jax.server.mock import MockEngine
from lp_jax.server.prometheus import parse_text

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "docs" / "grafana" / "lp_jax.json"
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]


def request(st_, method, path, body=None, headers=None):
    """(status, body bytes) over a fresh loopback connection."""
    conn = http.client.HTTPConnection("127.0.0.1", st_.port, timeout=30)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data,
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def ok(st_, path, body):
    status, data = request(st_, "POST", path, body)
    assert status == 200, (status, data[:300])
    return json.loads(data)


def error_param(status, data, expect=400):
    assert status == expect, (status, data[:300])
    return json.loads(data)["error"]["param"]


# ----------------------------------------------------------- version and ping
def test_lp_serve_version():
    out = subprocess.run([sys.executable, "-m", "lp_jax.serve", "--version"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"lp-serve {lp_jax.__version__}"
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", lp_jax.__version__)


def test_version_and_ping(mock_server):
    status, data = request(mock_server, "GET", "/version")
    assert status == 200 and json.loads(data) == {"version": lp_jax.__version__}
    for method in ("GET", "POST"):
        status, data = request(mock_server, method, "/ping")
        assert status == 200 and json.loads(data) == {"status": "ok"}


def test_ping_and_version_public_tokenizer_routes_keyed(tiny_dir):
    with start_server(MockEngine(model_dir=tiny_dir, max_model_len=64),
                      api_key="sekret") as st_:
        assert request(st_, "GET", "/ping")[0] == 200
        assert request(st_, "POST", "/ping")[0] == 200
        assert request(st_, "GET", "/version")[0] == 200
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
            assert request(st_, "POST", path, body)[0] == 401
            status, _ = request(st_, "POST", path, body,
                                headers={"Authorization": "Bearer sekret"})
            assert status == 200


# ------------------------------------------------------ tokenize and detokenize
def test_tokenize_prompt_matches_completions(mock_server):
    tok = ok(mock_server, "/tokenize", {"model": "mock", "prompt": "The engine serves"})
    assert set(tok) == {"count", "max_model_len", "tokens", "token_strs"}
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 64
    assert tok["token_strs"] is None
    usage = ok(mock_server, "/v1/completions",
               {"prompt": "The engine serves", "max_tokens": 1})["usage"]
    assert usage["prompt_tokens"] == tok["count"]
    # the ids run as the same prompt
    usage = ok(mock_server, "/v1/completions", {"prompt": tok["tokens"], "max_tokens": 1})
    assert usage["usage"]["prompt_tokens"] == tok["count"]
    back = ok(mock_server, "/detokenize", {"model": "mock", "tokens": tok["tokens"]})
    assert back == {"prompt": "The engine serves"}


def test_tokenize_options(mock_server):
    plain = ok(mock_server, "/tokenize", {"prompt": "hi there", "add_special_tokens": False})
    strs = ok(mock_server, "/tokenize", {"prompt": "hi there", "add_special_tokens": False,
                                         "return_token_strs": True})
    assert strs["tokens"] == plain["tokens"]
    assert len(strs["token_strs"]) == plain["count"]
    assert all(isinstance(s, str) and s for s in strs["token_strs"])
    assert ok(mock_server, "/tokenize", {"prompt": ""})["count"] >= 0
    assert ok(mock_server, "/detokenize", {"tokens": []}) == {"prompt": ""}


def test_tokenize_messages_matches_chat(mock_server):
    tok = ok(mock_server, "/tokenize", {"model": "mock", "messages": MSGS})
    usage = ok(mock_server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 1})
    assert tok["count"] == usage["usage"]["prompt_tokens"]
    no_gen = ok(mock_server, "/tokenize", {"messages": MSGS, "add_generation_prompt": False})
    assert no_gen["count"] < tok["count"]
    assert tok["tokens"][:no_gen["count"]] == no_gen["tokens"]


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": ["a", "b"]}, "prompt"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MSGS}, "prompt"),
    ("/tokenize", {}, None),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"content": "x"}]}, "messages"),
    ("/tokenize", {"messages": "hi"}, "messages"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"messages": MSGS, "add_generation_prompt": 1}, "add_generation_prompt"),
    ("/tokenize", {"prompt": "a", "return_token_strs": "no"}, "return_token_strs"),
    ("/tokenize", {"prompt": "a", "model": 3}, "model"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens"),
    ("/detokenize", {"tokens": [1, True]}, "tokens"),
    ("/detokenize", {"tokens": [1.5]}, "tokens"),
])
def test_tokenizer_routes_bad_input_is_400_naming_the_field(mock_server, path, body, param):
    status, data = request(mock_server, "POST", path, body)
    assert error_param(status, data) == param
    assert request(mock_server, "GET", "/health")[0] == 200


def test_tokenizer_routes_unknown_model_and_bad_json(mock_server):
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        status, data = request(mock_server, "POST", path, {**body, "model": "nope"})
        assert error_param(status, data, 404) == "model"
    conn = http.client.HTTPConnection("127.0.0.1", mock_server.port, timeout=30)
    conn.request("POST", "/tokenize", body=b"{not json")
    resp = conn.getresponse()
    assert resp.status == 400 and "error" in json.loads(resp.read())
    conn.close()


# ---------------------------------------------------------------- chat template
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_chat_template_file_replaces_the_models(tiny_dir, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    source = read_template_file(path)
    assert build_parser().parse_args(["--chat-template", str(path)]).chat_template == source
    with start_server(MockEngine(model_dir=tiny_dir, max_model_len=64),
                      chat_template=source) as st_:
        tok = ok(st_, "/tokenize", {"messages": MSGS})
        want = ok(st_, "/tokenize", {"prompt": "<system>Be brief.\n<user>Hello\n<assistant>",
                                     "add_special_tokens": False})
        assert tok["tokens"] == want["tokens"]
        usage = ok(st_, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 1})["usage"]
        assert usage["prompt_tokens"] == want["count"]


@pytest.mark.parametrize("content,why", [
    (None, "No such file"),
    ("", "is empty"),
    ("{% for m in messages %}{{ m.content }", "not a valid Jinja template: line 1"),
    ("{% if x %}never closed", "not a valid Jinja template"),
    (b"\xff\xfe\x00", "not UTF-8"),
])
def test_chat_template_file_errors_are_clear(tmp_path, capsys, content, why):
    path = tmp_path / "bad.jinja"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=why) as exc:
        read_template_file(path)
    assert str(path) in str(exc.value)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--chat-template", str(path)])
    err = capsys.readouterr().err
    assert "--chat-template" in err and str(path) in err and why in err


# -------------------------------------------------------------------- metrics
def _families(text: str) -> set[str]:
    """Every sample name /metrics serves: histograms' _bucket/_sum/_count included."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "histogram":
                names.update(f"{name}{s}" for s in ("_bucket", "_sum", "_count"))
        elif line and not line.startswith("#"):
            names.add(re.match(r"[^{ ]+", line).group())
    return names


def test_vllm_metric_names_mirror_the_lp_ones(tiny_dir):
    with start_server(MockEngine(model_dir=tiny_dir, max_model_len=64),
                      vllm_metric_names=True) as st_:
        ok(st_, "/v1/completions", {"prompt": "hi", "max_tokens": 3})
        text = request(st_, "GET", "/metrics")[1].decode()
    samples = parse_text(text)
    for lp_name, vllm_names in VLLM_NAMES.items():
        assert f"# TYPE {lp_name} " in text
        lp_samples = {k[len(lp_name):]: v for k, v in samples.items()
                      if re.match(re.escape(lp_name) + r"(_bucket|_sum|_count)?\{", k)}
        assert lp_samples, lp_name
        for name in vllm_names:
            assert name.startswith("vllm:")
            kind = re.search(rf"# TYPE {re.escape(lp_name)} (\w+)", text).group(1)
            assert f"# TYPE {name} {kind}" in text
            mirrored = {k[len(name):]: v for k, v in samples.items()
                        if re.match(re.escape(name) + r"(_bucket|_sum|_count)?\{", k)}
            assert mirrored == lp_samples, name
    for name in ("vllm:num_requests_running", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:kv_cache_usage_perc",
                 "vllm:request_success_total", "vllm:prompt_tokens_total"):
        assert f"# TYPE {name} " in text
    assert samples['vllm:generation_tokens_total{model_name="mock"}'] == 3
    # lp_jax's own metrics with no vLLM counterpart get no vllm: name
    assert "vllm:engine_healthy" not in text and "vllm:iterations_total" not in text


def test_no_vllm_names_by_default(mock_server):
    assert "vllm:" not in request(mock_server, "GET", "/metrics")[1].decode()
    assert build_parser().parse_args([]).vllm_metric_names is False
    assert build_parser().parse_args(["--vllm-metric-names"]).vllm_metric_names is True


_METRIC = re.compile(r"\b[a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]+")


def dashboard_exprs(dash: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel (rows' panels too) and every
    query variable."""
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                out.append((p.get("title", "?"), t.get("expr", "")))
            walk(p.get("panels", []))

    walk(dash["panels"])
    for var in dash.get("templating", {}).get("list", []):
        q = var.get("query")
        if var.get("type") == "query":
            out.append((f"${var['name']}", q["query"] if isinstance(q, dict) else q))
    return out


def referenced_metrics(expr: str) -> set[str]:
    """Metric names in a PromQL expression: every name with a colon (recording-rule style,
    as lp: and vllm: are), outside label matchers and strings."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values, legend text
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    return set(_METRIC.findall(expr))


def test_referenced_metrics_parser():
    e = ('histogram_quantile(0.9, sum by (le) (rate(lp:ttft_seconds_bucket{model_name='
         '"$model_name", x="a:b"}[$__rate_interval]))) / lp:other_total')
    assert referenced_metrics(e) == {"lp:ttft_seconds_bucket", "lp:other_total"}


def test_grafana_dashboard_reads_only_served_metrics(tiny_dir):
    dash = json.loads(DASHBOARD.read_text())
    exprs = dashboard_exprs(dash)
    assert len(dash["panels"]) >= 12 and all(p.get("targets") for p in dash["panels"])
    eng = MockEngine(model_dir=tiny_dir, max_model_len=64,
                     slo_classes={"chat": {"ttft_ms": 250, "tbt_ms": 100}})
    with start_server(eng) as st_:
        ok(st_, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        served = _families(request(st_, "GET", "/metrics")[1].decode())
    used = set()
    for title, expr in exprs:
        names = referenced_metrics(expr)
        assert names, f"panel {title!r}: no metric in {expr!r}"
        missing = names - served
        assert not missing, f"panel {title!r} reads {sorted(missing)}, not served"
        used |= names
    assert all(n.startswith("lp:") for n in used)
    # the dashboard covers the headline metrics
    for name in ("lp:time_to_first_token_seconds_bucket", "lp:inter_token_latency_seconds_bucket",
                 "lp:e2e_request_latency_seconds_bucket", "lp:num_requests_running",
                 "lp:kv_cache_usage_perc", "lp:generation_tokens_total",
                 "lp:request_success_total"):
        assert name in used, name


# -------------------------------------------------------------------- packaging
def test_pyproject_license_is_spdx_without_deprecation_notice():
    import tomllib

    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert not any(c.startswith("License ::") for c in project.get("classifiers", []))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    notices = [str(w.message) for w in caught if "license" in str(w.message).lower()]
    assert not notices, notices
    assert dist.metadata.license_expression == "Apache-2.0"
