"""One engine over two processes (jax.distributed, gloo, 4 host devices each): the
leader/follower flow of lp_jax/executor/distributed.py and plan_channel.py.

* LLM on a (2, 4) expert x tensor mesh spanning both processes (tensor-parallel attention
  with more devices than KV heads, the experts over all 8 devices) gives the Hugging Face
  golden greedy tokens (tests/golden/tiny.npz), as one process does, under chunked (host
  plan channel) with EAGLE-3 drafts (test_spec_eagle's two-token head, k = 3, on every
  process; both sequences draft); the leader's shutdown ends the follower (exit 0), and
  no program compiles while serving.
* Layered prefill (device broadcast) with data-parallel attention over the two processes,
  DP 2 x TP 4 with the experts over all 8 devices, of tiny-deepseek (MLA) with MTP drafts
  (its next-token layer, k = 3, on every process): a data rank a process, each holding
  only its rank's half of the KV pool and of the draft's; the two prompts go to the two
  ranks and give the golden tokens; drafts are proposed on both ranks' rows and some
  stand, every step's drafts agree on both processes (the followers' acks carry their
  crc), every page returns. (Layered on the (2, 4) layout above is the single-process
  tests'; one engine fewer to start here.)
* lp-serve on two processes (the chunked run's arguments and head, so its program comes
  from the run's compilation cache): the leader answers HTTP with the same tokens' text;
  the follower serves no HTTP; a follower killed mid-stream makes the leader exit at once
  with its own line (exit 3), not hang in a collective or wait for JAX's heartbeat abort
  (exit 134).
* The wire format round-trips (a draft model's inputs too), a follower acks the drafts the
  leader reads, and bad distributed arguments are refused.
"""

import http.client
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import CPU_O0_XLA_FLAGS

from lp_jax.bench.processes import free_port, process_env
from lp_jax.executor import distributed
from lp_jax.executor.plan_channel import StepCodec
from lp_jax.executor.step import StepSpec, empty_inputs
from tests.multiprocess_common import (
    DP_PAGES,
    ENGINE_ARGS,
    GOLDEN_TOKENS,
    MTP_GOLDEN_TOKENS,
    NEW_TOKENS,
    PROMPTS,
    eagle3_config,
)

ROOT = Path(__file__).resolve().parents[1]


def _env(pid, port):
    env = process_env(pid, 2, port, cpu_devices=4)
    env["PYTHONPATH"] = str(ROOT)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {CPU_O0_XLA_FLAGS}".strip()
    return env


@pytest.fixture(scope="module")
def eagle3_dir(tiny_dir, tmp_path_factory):
    """test_spec_eagle's two-token EAGLE-3 head for tiny."""
    from test_spec_eagle import _two_token_head

    return _two_token_head(tiny_dir, tmp_path_factory.mktemp("eagle3") / "head")


@pytest.fixture(scope="module")
def golden_text(tiny_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_dir / "tokenizer.json")).decode(GOLDEN_TOKENS[0])


def test_two_process_engine_matches_the_golden_tokens(tiny_dir, two_token_mtp_dir, eagle3_dir,
                                                      tmp_path):
    port, out = free_port(), tmp_path / "tokens.json"
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "multiprocess_worker.py"),
                               str(tiny_dir), str(two_token_mtp_dir), str(eagle3_dir),
                               str(out)],
                              env=_env(pid, port), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for pid in (0, 1)]
    logs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(
        f"--- process {pid} ---\n" + _tail(log) for pid, log in enumerate(logs))
    results = json.loads(out.read_text())
    for policy, transport in (("chunked", "host"), ("dp", "device")):
        channel = results[policy]["plan_channel"]
        assert channel["transport"] == transport and channel["steps_sent"] >= NEW_TOKENS
    chunked = results["chunked"]
    assert chunked["tokens"] == GOLDEN_TOKENS and chunked["compilations_after_warmup"] == 0
    # 2 KV heads on 4 tensor devices: each kept twice, one per device.
    assert chunked["layout"] == {"kv_heads": 4, "kv_heads_per_device": 1, "expert_devices": 8}
    dp = results["dp"]
    assert dp["tokens"] == MTP_GOLDEN_TOKENS and dp["compilations_after_warmup"] == 0
    layout = dp["layout"]
    assert layout["rank_processes"] == [[0], [1]] and layout["expert_devices"] == 8
    assert layout["pool_rows_per_device"] * 2 == layout["pool_rows"]
    assert layout["draft_pool_rows_per_device"] * 2 == layout["draft_pool_rows"]
    # Both sequences drafted at most steps: EAGLE-3 (chunked), MTP on each rank's rows
    # (dp), where some drafts stand (prompt 0's 237, 237, 237, 446 are the head's tokens).
    for run in ("spec_chunked", "spec_dp"):
        spec = results[run]
        assert len(spec["drafting_steps"]) == 2 and min(spec["drafting_steps"]) > 2, run
        assert spec["programs"] == 1 and spec["startup_compilations"] <= 32
    spec = results["spec_dp"]
    assert 0 < spec["spec_decode_num_accepted_tokens"] < spec["spec_decode_num_draft_tokens"]
    bal = layout["data_parallel"]
    assert bal["seqs"] == [0, 0] and min(bal["rows"]) > 0  # a prompt on each rank
    assert bal["free_pages"] == [DP_PAGES] * 2 and layout["free_pages"] == [2 * DP_PAGES] * 2
    assert "leader of 2 processes (8 devices)" in logs[0]


def _tail(log: str, n: int = 4000) -> str:
    """A process's log without gloo's and absl's chatter, last n characters."""
    keep = [line for line in log.splitlines()
            if not line.startswith(("[Gloo]", "I1", "W1", "I0", "W0"))]
    return "\n".join(keep)[-n:]


def _post(port, body, timeout=120):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def test_server_on_two_processes_and_a_dying_follower(tiny_dir, eagle3_dir, golden_text):
    port = free_port()
    args = ["-m", "lp_jax.serve", "--model", str(tiny_dir), "--port", "0",
            "--speculative-config", json.dumps(eagle3_config(eagle3_dir)),
            "--mesh-shape", "2,4", "--scheduling", "chunked",
            "--max-num-seqs", str(ENGINE_ARGS["max_num_seqs"]),
            "--max-num-batched-tokens", str(ENGINE_ARGS["max_num_batched_tokens"]),
            "--token-buckets", ",".join(map(str, ENGINE_ARGS["token_buckets"])),
            "--compilation-cache-dir", ""]
    procs = [subprocess.Popen([sys.executable, *args], env=_env(pid, port), cwd=ROOT,
                              stdout=subprocess.DEVNULL if pid else None,
                              stderr=subprocess.PIPE, text=True) for pid in (0, 1)]
    try:
        for line in procs[0].stderr:
            if m := re.search(r"serving .* on http://127\.0\.0\.1:(\d+)", line):
                http_port = int(m.group(1))
                break
        else:
            pytest.fail(f"the leader exited with {procs[0].wait()}")
        # The leader serves the one-process tokens.
        conn, resp = _post(http_port, {"prompt": PROMPTS[0], "max_tokens": NEW_TOKENS,
                                       "temperature": 0.0})
        assert resp.status == 200
        body = json.loads(resp.read())
        conn.close()
        assert body["choices"][0]["text"] == golden_text
        # A follower killed mid-stream: the leader ends itself, with its own line.
        conn, resp = _post(http_port, {"prompt": PROMPTS[1], "max_tokens": 400,
                                       "ignore_eos": True, "stream": True})
        assert resp.readline().startswith(b"data: ")
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        rc = procs[0].wait(timeout=60)
        waited = time.monotonic() - t0
        err = procs[0].stderr.read()
        assert rc == 3, err[-3000:]
        assert "lp_jax leader: follower process 1 disconnected" in err
        assert waited < 30
        follower_err = procs[1].stderr.read()
        assert "serving" not in follower_err  # followers serve no HTTP
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.parametrize("draft_k", [0, 2])
def test_step_codec_round_trips(draft_k):
    """Every input leaf, a draft model's (inputs["draft"]) included, comes back."""
    spec = StepSpec(num_layers=4, hidden_size=8, page_size=4, pages_per_seq=6, max_num_seqs=4,
                    hidden_rows=12, buckets=(2, 8), vocab_size=0, draft_k=draft_k)
    codec = StepCodec(spec)
    rng = np.random.default_rng(0)
    calls = []
    for N in (8, 2):
        inputs = empty_inputs(spec, N)
        assert ("draft" in inputs) == bool(draft_k)
        if draft_k:
            for x in inputs["draft"].values():
                x[:] = rng.integers(-1, 100, x.shape)
        inputs["tokens_N"][:] = rng.integers(0, 1000, N)
        inputs["meta"].page_table_BC[:] = rng.integers(0, 50, inputs["meta"].page_table_BC.shape)
        inputs["sampling"]["temperature"][:] = rng.random(spec.seqs_for(N))
        inputs["do_sample"] = np.bool_(N == 2)
        calls.append((N, inputs))
    step_id, prev, decoded = codec.decode(codec.encode(7, 6, calls))
    assert (step_id, prev) == (7, 6)
    import jax

    for (N, want), (M, got) in zip(calls, decoded, strict=True):
        assert N == M
        want = {k: v for k, v in want.items() if k != "prev_tokens_R"}
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)
    with pytest.raises(ValueError, match="magic"):
        codec.decode(b"\0" * 64)


def test_followers_ack_the_drafts_the_leader_reads():
    """A follower acks each step with its tokens (the sampling call's) and its drafts (the
    call whose rows leave the last layer: the array the leader's handle reads), and the
    crc32 the leader compares tells different drafts apart."""
    from lp_jax.executor.plan_channel import run_follower, tokens_crc

    tokens_R, other_R = np.arange(4, dtype=np.int32), np.zeros(4, np.int32)
    drafts_RK = np.arange(12, dtype=np.int32).reshape(4, 3)

    class Runner:  # two calls: units [0, 2) then [2, 4) of L = 2 layers, which samples
        L = 2

        class codec:
            decode = staticmethod(lambda payload: (5, -1, [
                (8, {"units": np.array([0, 2]), "do_sample": np.bool_(False)}),
                (8, {"units": np.array([2, 4]), "do_sample": np.bool_(True)})]))

        def run_calls(self, batch, prev):
            return [], [{"tokens_R": other_R, "drafts_RK": -drafts_RK},
                        {"tokens_R": tokens_R, "drafts_RK": drafts_RK}]

    class Channel:
        def __init__(self):
            self.payloads, self.acks = [b"step"], []

        def recv_step(self):
            return self.payloads.pop() if self.payloads else None

        def ack(self, *args):
            self.acks.append(args)

    channel = Channel()
    assert run_follower(Runner(), channel) == 1
    (step_id, acked_R, acked_RK), = channel.acks
    assert step_id == 5 and acked_R is tokens_R and acked_RK is drafts_RK
    assert tokens_crc(tokens_R, drafts_RK) != tokens_crc(tokens_R, drafts_RK[::-1])
    assert tokens_crc(tokens_R, None) == tokens_crc(tokens_R)  # engines without drafts


def test_distributed_arguments_are_checked(monkeypatch):
    for var in (distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID,
                distributed.ENV_COORDINATOR, "SLURM_NTASKS", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(var, raising=False)
    assert distributed.resolve() is None
    with pytest.raises(ValueError, match="needs num_processes, process_id and coordinator"):
        distributed.resolve(num_processes=2, process_id=0)
    with pytest.raises(ValueError, match=r"not in \[0, 2\)"):
        distributed.resolve(2, 2, "127.0.0.1:1234")
    with pytest.raises(ValueError, match="host:port"):
        distributed.resolve(2, 1, "localhost")
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "4")
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "3")
    monkeypatch.setenv(distributed.ENV_COORDINATOR, "10.0.0.1:8476")
    assert distributed.resolve() == {"num_processes": 4, "process_id": 3,
                                     "coordinator_address": "10.0.0.1:8476"}
    assert distributed.resolve(process_id=1)["process_id"] == 1  # flags beat the env
    monkeypatch.delenv(distributed.ENV_NUM_PROCESSES)
    monkeypatch.delenv(distributed.ENV_PROCESS_ID)
    monkeypatch.delenv(distributed.ENV_COORDINATOR)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    assert distributed.resolve() == {}  # JAX's own cluster detection fills them in
