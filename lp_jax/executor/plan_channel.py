"""The leader -> follower plan channel of a multi-process engine (see distributed.py).

    leader (process 0)                               follower k (process k > 0)
    ------------------                               --------------------------
    scheduler.schedule() -> StepPlan
    runner.dispatch(plan):
      calls = [(N, inputs)] (numpy)      ---- STEP ---->  decode_step -> same calls
      run calls on local shards          <- collectives ->  run calls on local shards
    handle.collect(): tokens_R          <---- ACK -----   crc32(tokens_R, drafts_RK)
      compare crc32s (tokens must agree)
    shutdown                              ---- STOP ---->  leave the loop

**Wire format.** A step is its calls' program inputs, the only thing a follower needs:
an int64 header [magic, step id, previous step id, calls, N_0, N_1, N_2, 0] and then, per
call, the leaves of `step.empty_inputs(spec, N)` (minus `prev_tokens_R`) as raw bytes in
the template's order. The layout is fixed by the row bucket N, so nothing is pickled or
described: a decode step of 32 sequences at max_model_len 4096 is ~35 KB, most of it the
page table. `prev_tokens_R`, the previous step's sampled tokens on device, is not sent:
the follower keeps its own copy of every step's tokens (identical by construction, and
checked: each follower acks every step with a crc32 of its tokens, and of a draft model's
proposals `drafts_RK` where the engine has one, and the leader compares them with its
own). A draft model's inputs (`inputs["draft"]`, step.py) are leaves of the template
like any other, and its state (the one-layer KV pool, an EAGLE-3 head's aux buffer)
lives on every process as the target's, so followers run the same draft programs. The
structured-output bitmask (`sampling["bitmask_SW"]`, [B, ceil(V/32)] int32, 4.9 MB at
Qwen3's vocabulary and 256 rows) is not in the fixed layout either: each call ends with
its constrained rows only, an int64 count r, r int32 row indices and their r x W words;
r = 0 (None in the inputs: all ones) costs 8 bytes.

**Transports** (`plan_channel=`), both measured in BENCHMARKS.md (launch/bench_multihost.py):
- "host": a TCP connection per follower. The leader listens on an ephemeral port and
  publishes host:port in JAX's coordination-service key-value store, so no extra port
  or flag is needed.
- "device": `multihost_utils.broadcast_one_to_all` of a fixed [4] int32 header and then
  the payload padded to 4 KiB x 16^i (a handful of small programs, run once at start-up
  by `warm_broadcasts` so none compiles while serving).
The TCP connections carry the hand-shake, the acks and STOP in both modes.

**Failures.** A follower that exits or crashes closes its connection: the leader sees
EOF at once and ends itself with one line of its own (`distributed.fatal`), rather than
hanging in the next collective until JAX's heartbeat aborts it (~100 s, exit 134). A
follower that stops answering (hung, stopped) leaves its acks behind: after
`follower_timeout_s` without an ack for a dispatched step, the leader ends the same way.
A follower that loses its leader ends too; STOP (sent by `shutdown()` and at exit) ends
followers cleanly.
"""

from __future__ import annotations

import atexit
import json
import queue
import socket
import struct
import threading
import time
import zlib

import jax
import numpy as np

from lp_jax.executor import distributed
from lp_jax.executor.step import StepSpec, empty_inputs

MAGIC = 0x4C50_4A41  # "LPJA"
MAX_CALLS = 3
_KEY = "lp_jax/plan_channel/{}"
_generation = iter(range(1 << 30))  # engines built in this process, the same on every one
_HDR = struct.Struct("!IB")  # frame: payload length, kind
HELLO, SETUP, READY, STEP, STOP, ACK = range(1, 7)
TRANSPORTS = ("host", "device")


# --------------------------------------------------------------------- wire format
class StepCodec:
    """Encodes a step's calls as fixed-layout bytes and back, per StepSpec."""

    def __init__(self, spec: StepSpec):
        self.spec = spec
        self._layouts: dict[int, tuple] = {}

    def _layout(self, N: int):
        if N not in self._layouts:
            template = empty_inputs(self.spec, N)
            del template["prev_tokens_R"]
            template["sampling"].pop("bitmask_SW", None)
            leaves, treedef = jax.tree.flatten(template)
            leaves = [np.asarray(x) for x in leaves]
            self._layouts[N] = (treedef, [(x.shape, x.dtype, x.nbytes) for x in leaves])
        return self._layouts[N]

    def encode(self, step_id: int, prev_step: int, calls: list[tuple[int, dict]]) -> bytes:
        if len(calls) > MAX_CALLS:
            raise ValueError(f"a step has at most {MAX_CALLS} calls, got {len(calls)}")
        header = np.zeros(8, np.int64)
        header[:4] = MAGIC, step_id, prev_step, len(calls)
        header[4 : 4 + len(calls)] = [N for N, _ in calls]
        parts = [header.tobytes()]
        for N, inputs in calls:
            inputs = {k: v for k, v in inputs.items() if k != "prev_tokens_R"}
            sampling = dict(inputs["sampling"])
            mask_BW = sampling.pop("bitmask_SW", None)
            leaves = jax.tree.leaves({**inputs, "sampling": sampling})
            layout = self._layout(N)[1]
            if len(leaves) != len(layout):
                raise ValueError(f"inputs of a {N}-row call do not match the template")
            for x, (shape, dtype, _) in zip(leaves, layout, strict=True):
                parts.append(np.ascontiguousarray(x, dtype).reshape(shape).tobytes())
            if self.spec.vocab_size:
                parts += self._encode_mask(mask_BW)
        return b"".join(parts)

    def _encode_mask(self, mask_BW) -> list[bytes]:
        """A call's bitmask as its rows that are not all ones (None: all ones)."""
        if mask_BW is None:
            return [np.int64(0).tobytes()]
        mask_BW = np.asarray(mask_BW, np.int32)
        if mask_BW.shape[1] != self.spec.mask_words:
            raise ValueError(f"bitmask rows of {mask_BW.shape[1]} words, the spec's have "
                             f"{self.spec.mask_words}")
        rows = np.flatnonzero((mask_BW != -1).any(axis=1)).astype(np.int32)
        return [np.int64(len(rows)).tobytes(), rows.tobytes(),
                np.ascontiguousarray(mask_BW[rows]).tobytes()]

    def max_message_bytes(self) -> int:
        """The largest step message: MAX_CALLS calls of the largest bucket."""
        N = self.spec.buckets[-1]
        layout = self._layout(N)[1]
        mask = 8 + self.spec.seqs_for(N) * 4 * (1 + self.spec.mask_words)  # every row
        return 8 * 8 + MAX_CALLS * (sum(nbytes for _, _, nbytes in layout)
                                    + (mask if self.spec.vocab_size else 0))

    def decode(self, payload: bytes) -> tuple[int, int, list[tuple[int, dict]]]:
        header = np.frombuffer(payload, np.int64, 8)
        if int(header[0]) != MAGIC:
            raise ValueError("not a step message (bad magic)")
        step_id, prev_step, n = int(header[1]), int(header[2]), int(header[3])
        offset, calls = header.nbytes, []
        for N in header[4 : 4 + n]:
            treedef, layout = self._layout(int(N))
            leaves = []
            for shape, dtype, nbytes in layout:
                leaves.append(np.frombuffer(payload, dtype, int(np.prod(shape)), offset)
                              .reshape(shape))
                offset += nbytes
            inputs = jax.tree.unflatten(treedef, leaves)
            if self.spec.vocab_size:
                inputs["sampling"]["bitmask_SW"], offset = self._decode_mask(
                    payload, offset, self.spec.seqs_for(int(N)))
            calls.append((int(N), inputs))
        if offset != len(payload):
            raise ValueError(f"step message has {len(payload) - offset} trailing bytes")
        return step_id, prev_step, calls


    def _decode_mask(self, payload: bytes, offset: int, B: int):
        """(the call's [B, W] bitmask, or None for all ones; the offset after it)."""
        r = int(np.frombuffer(payload, np.int64, 1, offset)[0])
        offset += 8
        if r == 0:
            return None, offset
        W = self.spec.mask_words
        rows = np.frombuffer(payload, np.int32, r, offset)
        offset += 4 * r
        mask_BW = np.full((B, W), -1, np.int32)
        mask_BW[rows] = np.frombuffer(payload, np.int32, r * W, offset).reshape(r, W)
        return mask_BW, offset + 4 * r * W


def tokens_crc(tokens: np.ndarray | None, drafts: np.ndarray | None = None) -> int:
    """A step's check value: crc32 of its sampled tokens, then of its drafts (if any)."""
    crc = 0 if tokens is None else zlib.crc32(np.ascontiguousarray(tokens).tobytes())
    if drafts is not None:
        crc = zlib.crc32(np.ascontiguousarray(drafts).tobytes(), crc)
    return crc


# ------------------------------------------------------------------------ framing
def _send(sock: socket.socket, kind: int, payload: bytes = b""):
    sock.sendall(_HDR.pack(len(payload), kind) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket) -> tuple[int, bytes] | None:
    """(kind, payload), or None when the peer closed the connection."""
    try:
        head = _recv_exact(sock, _HDR.size)
        if head is None:
            return None
        n, kind = _HDR.unpack(head)
        payload = _recv_exact(sock, n) if n else b""
    except OSError:
        return None
    return None if payload is None else (kind, payload)


def _kv_client():
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


def _slot(nbytes: int) -> int:
    """The device transport's payload sizes: 4 KiB x 16^i, so a few programs (compiled at
    start-up, `warm_broadcasts`) carry every step."""
    size = 4096
    while size < nbytes:
        size *= 16
    return size


def _broadcast(header_4: np.ndarray, payload: np.ndarray | None = None):
    """Device broadcast from process 0: a [4] int32 header, then (if header[1] > 0)
    the payload in a uint8 buffer of `_slot` size."""
    from jax.experimental import multihost_utils

    header_4 = np.asarray(multihost_utils.broadcast_one_to_all(header_4))
    nbytes = int(header_4[1])
    if nbytes == 0:
        return header_4, b""
    buf = np.zeros(_slot(nbytes), np.uint8)
    if payload is not None:
        buf[:nbytes] = payload
    out = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return header_4, out[:nbytes].tobytes()


def warm_broadcasts(max_bytes: int):
    """Runs every broadcast program the device transport can use once, on every process
    in the same order (they are collectives), so none compiles while serving."""
    size = 4096
    while True:
        _broadcast(np.array([0, size, 0, 0], np.int32), np.zeros(size, np.uint8))
        if size >= max_bytes:
            return
        size *= 16


# ------------------------------------------------------------------------- leader
class LeaderChannel:
    """Process 0's end: accepts every follower, sends steps, watches acks."""

    def __init__(self, info: distributed.ProcessInfo, *, transport: str = "host",
                 timeout_s: float = 60.0, connect_timeout_s: float = 300.0):
        if transport not in TRANSPORTS:
            raise ValueError(f"plan_channel must be one of {TRANSPORTS}, got {transport!r}")
        self.transport, self.timeout_s = transport, timeout_s
        self.followers = range(1, info.num_processes)
        self._key = _KEY.format(next(_generation))
        server = socket.create_server(("", 0))
        host = socket.gethostbyname(socket.gethostname())
        _kv_client().key_value_set(self._key,
                                   f"{host}:{server.getsockname()[1]}")
        self._socks: dict[int, socket.socket] = {}
        deadline = time.monotonic() + connect_timeout_s
        while len(self._socks) < len(self.followers):
            server.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                sock, _ = server.accept()
            except TimeoutError:
                missing = sorted(set(self.followers) - set(self._socks))
                raise RuntimeError(f"followers {missing} did not connect within "
                                   f"{connect_timeout_s:.0f} s") from None
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            msg = _recv(sock)
            if msg is None or msg[0] != HELLO:
                sock.close()
                continue
            self._socks[json.loads(msg[1])["process_id"]] = sock
        server.close()
        self._lock = threading.Lock()
        self._pending: dict[int, float] = {}  # step id -> sent at, until every ack
        self._acks: dict[int, dict[int, int]] = {}  # step id -> {process: crc}
        self._mine: dict[int, int] = {}  # step id -> the leader's crc
        self._ready: set[int] = set()
        self._ready_event = threading.Event()
        self._stopped = False
        self.sent_bytes = 0
        self.send_seconds = 0.0
        self.steps_sent = 0
        for pid, sock in self._socks.items():
            threading.Thread(target=self._watch, args=(pid, sock), daemon=True,
                             name=f"lp-follower-{pid}").start()
        threading.Thread(target=self._monitor, daemon=True, name="lp-follower-monitor").start()
        atexit.register(self.stop)

    def setup(self, settings: dict):
        """Sends the leader's resolved start-up settings (page count, kernel backends,
        the engine arguments to compare) to every follower."""
        data = json.dumps(settings).encode()
        for sock in self._socks.values():
            _send(sock, SETUP, data)

    def wait_ready(self, timeout_s: float):
        """Blocks until every follower has compiled its programs."""
        if not self._ready_event.wait(timeout_s):
            missing = sorted(set(self.followers) - self._ready)
            distributed.fatal(f"followers {missing} were not ready within {timeout_s:.0f} s")

    def send_step(self, step_id: int, payload: bytes):
        t0 = time.perf_counter()
        with self._lock:
            self._pending[step_id] = time.monotonic()
        if self.transport == "host":
            frame = _HDR.pack(len(payload), STEP) + payload
            for pid, sock in self._socks.items():
                try:
                    sock.sendall(frame)
                except OSError as e:
                    distributed.fatal(f"follower process {pid} is gone ({e}); stopping")
        else:
            _broadcast(np.array([STEP, len(payload), 0, 0], np.int32),
                       np.frombuffer(payload, np.uint8))
        self.send_seconds += time.perf_counter() - t0
        self.sent_bytes += len(payload)
        self.steps_sent += 1

    def record_tokens(self, step_id: int, tokens: np.ndarray | None,
                      drafts: np.ndarray | None = None):
        """The leader's own tokens (and drafts) of a step, to compare with the followers'
        acks."""
        with self._lock:
            self._mine[step_id] = tokens_crc(tokens, drafts)
            self._settle(step_id)

    def _settle(self, step_id: int):
        acks, mine = self._acks.get(step_id, {}), self._mine.get(step_id)
        if mine is None:
            return
        for pid, crc in acks.items():
            if crc != mine:
                distributed.fatal(f"follower {pid} sampled different tokens or drafts at step "
                                  f"{step_id} (crc {crc:#x} vs {mine:#x}); stopping")
        if len(acks) == len(self.followers):
            self._acks.pop(step_id, None)
            self._mine.pop(step_id, None)

    def _watch(self, pid: int, sock: socket.socket):
        while True:
            msg = _recv(sock)
            if msg is None:
                if not self._stopped:
                    distributed.fatal(f"follower process {pid} disconnected (it exited or "
                                      "crashed); the SPMD step cannot run without it, "
                                      "so the leader stops")
                return
            kind, payload = msg
            if kind == READY:
                with self._lock:
                    self._ready.add(pid)
                    if len(self._ready) == len(self.followers):
                        self._ready_event.set()
            elif kind == ACK:
                step_id, crc = struct.unpack("!qQ", payload)
                with self._lock:
                    self._acks.setdefault(step_id, {})[pid] = crc
                    if len(self._acks[step_id]) == len(self.followers):
                        self._pending.pop(step_id, None)
                    self._settle(step_id)

    def _monitor(self):
        while not self._stopped:
            time.sleep(min(1.0, self.timeout_s / 4))
            with self._lock:
                oldest = min(self._pending.items(), default=None, key=lambda kv: kv[1])
            if oldest is not None and time.monotonic() - oldest[1] > self.timeout_s:
                acks = self._acks.get(oldest[0], {})
                late = sorted(set(self.followers) - set(acks))
                distributed.fatal(f"followers {late} have not answered step {oldest[0]} for "
                                  f"{self.timeout_s:.0f} s; stopping")

    def stop(self):
        """Ends every follower's loop (idempotent; also runs at exit)."""
        if self._stopped:
            return
        self._stopped = True
        if self.transport == "device":
            try:
                _broadcast(np.array([STOP, 0, 0, 0], np.int32))
            except Exception:  # noqa: BLE001 - a follower may be gone already
                pass
        for sock in self._socks.values():
            try:
                _send(sock, STOP)
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def stats(self) -> dict:
        n = max(self.steps_sent, 1)
        return {"transport": self.transport, "steps_sent": self.steps_sent,
                "bytes_per_step": self.sent_bytes / n,
                "send_ms_per_step": 1e3 * self.send_seconds / n}


# ----------------------------------------------------------------------- follower
class FollowerChannel:
    """A follower's end: connects to the leader, receives steps, acks them."""

    def __init__(self, info: distributed.ProcessInfo, *, transport: str = "host",
                 connect_timeout_s: float = 300.0):
        self.transport = transport
        address = _kv_client().blocking_key_value_get(_KEY.format(next(_generation)),
                                                      int(connect_timeout_s * 1000))
        host, port = address.rsplit(":", 1)
        self._sock = socket.create_connection((host, int(port)), timeout=connect_timeout_s)
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _send(self._sock, HELLO, json.dumps({"process_id": info.process_id}).encode())
        self._acks: queue.Queue = queue.Queue()
        self._send_lock = threading.Lock()
        self._closing = False
        self._ack_thread = threading.Thread(target=self._ack_loop, daemon=True, name="lp-acks")
        self._ack_thread.start()

    def setup(self) -> dict:
        msg = _recv(self._sock)
        if msg is None or msg[0] != SETUP:
            distributed.fatal("the leader closed the plan channel during start-up")
        return json.loads(msg[1])

    def ready(self):
        self._send(READY)

    def recv_step(self) -> bytes | None:
        """The next step's payload, or None on STOP."""
        if self.transport == "device":
            header_4, payload = _broadcast(np.zeros(4, np.int32))
            return None if int(header_4[0]) == STOP else payload
        msg = _recv(self._sock)
        if msg is None:
            distributed.fatal("the leader closed the plan channel without a stop; exiting")
        kind, payload = msg
        return None if kind == STOP else payload

    def ack(self, step_id: int, tokens_R: jax.Array | None,
            drafts_RK: jax.Array | None = None):
        """Acks a step once its tokens (and drafts) exist, without blocking the caller."""
        self._acks.put((step_id, tokens_R, drafts_RK))

    def _ack_loop(self):
        while (item := self._acks.get()) is not None:
            step_id, *arrays = item
            crc = tokens_crc(*(None if x is None else host_array(x) for x in arrays))
            self._send(ACK, struct.pack("!qQ", step_id, crc))

    def _send(self, kind: int, payload: bytes = b""):
        with self._send_lock:
            try:
                _send(self._sock, kind, payload)
            except OSError as e:
                if not self._closing:  # after STOP the leader may be gone: nothing is lost
                    distributed.fatal(f"lost the leader ({e}); exiting")

    def close(self):
        """After STOP: sends the acks still queued, then closes the connection."""
        self._closing = True
        self._acks.put(None)
        self._ack_thread.join(timeout=30)
        try:
            self._sock.close()
        except OSError:
            pass


def host_array(x: jax.Array) -> np.ndarray:
    """A replicated array's value on this host (np.asarray refuses arrays with shards on
    other processes)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(x.addressable_data(0))


def run_follower(runner, channel: FollowerChannel) -> int:
    """A follower's loop: runs every step the leader sends, in order, on this process's
    shards, until STOP. Returns the number of steps run."""
    tokens: dict[int, jax.Array] = {}  # step id -> its sampled tokens (the last few)
    steps = 0
    while (payload := channel.recv_step()) is not None:
        step_id, prev_id, batch = runner.codec.decode(payload)
        prev = None
        if prev_id >= 0:
            prev = tokens.get(prev_id)
            if prev is None:
                distributed.fatal(f"step {step_id} reads the tokens of step {prev_id}, "
                                  "which this follower does not hold")
        _, outs = runner.run_calls(batch, prev)
        tokens_R = next((o["tokens_R"] for (_, x), o in zip(batch, outs, strict=True)
                         if x["do_sample"]), None)
        # A draft model's proposals: those of the call whose rows leave the last layer,
        # the array the leader's handle reads (ModelRunner.dispatch).
        drafts_RK = next((o["drafts_RK"] for (_, x), o in zip(batch, outs, strict=True)
                          if "drafts_RK" in o and x["units"][1] == 2 * runner.L), None)
        if tokens_R is not None:
            tokens[step_id] = tokens_R
            for old in [k for k in tokens if k < step_id - 4]:
                del tokens[old]
        channel.ack(step_id, tokens_R, drafts_RK)
        steps += 1
    return steps
