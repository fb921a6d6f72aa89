"""What the soak (launch/soak.py) sends and what each answer must be: the seeded request
mix (`Mix`, `KINDS`: plain and streamed completions and chat, n > 1, logprobs and
top_logprobs, prompt_logprobs, prompts sharing a long prefix, penalties, clients that leave
mid-stream or before the answer, and bad requests with the 4xx each should get), and the
checks of a non-streamed answer (`check_body`) and of a stream (`check_stream`)."""

from __future__ import annotations

import json
import random

# kind -> weight (out of 100) in the mix
KINDS = {"completion": 13, "completion_stream": 13, "chat": 8, "chat_stream": 8, "n": 8,
         "logprobs": 8, "prompt_logprobs": 5, "prefix": 12, "penalty": 8, "cut": 10,
         "bad": 7}
CUT_MAX_TOKENS = 64  # a cut request asks for this many; the client leaves long before
INVALID_ROUTES = {("POST", "/v1/completions"), ("POST", "/v1/chat/completions")}
ERROR_KEYS = {"message", "type", "param", "code"}
WORDS = ("the engine serves tokens layer by layer while requests wait in the queue and "
         "pages of cache hold every prefix that was seen before").split()


def bad_cases(max_model_len: int) -> list[tuple[str, str, bytes, int]]:
    """(method, path, body, expected status). Those POSTed to a generation route
    (INVALID_ROUTES) count in lp:request_rejected_total{reason="invalid"}."""
    def js(obj) -> bytes:
        return json.dumps(obj).encode()

    user = [{"role": "user", "content": "hi"}]
    return [
        ("POST", "/v1/completions", b"{", 400),
        ("POST", "/v1/completions", js({"prompt": "x", "n": 99}), 400),
        ("POST", "/v1/completions", js({"prompt": [1] * (max_model_len + 1)}), 400),
        ("POST", "/v1/completions", js({"model": "no-such-model", "prompt": "x"}), 404),
        ("POST", "/v1/completions", js({"prompt": "x", "temperature": -1}), 400),
        ("POST", "/v1/completions", js({"prompt": "x", "logit_bias": {"\u00b2": 1}}), 400),
        ("POST", "/v1/completions", js({"prompt": ["a", [1, 2]]}), 400),
        ("POST", "/v1/completions", js({"prompt": "x", "best_of": 2}), 400),
        ("POST", "/v1/completions", js({"prompt": "x", "prompt_logprobs": 21}), 400),
        ("POST", "/v1/completions",
         js({"prompt": "x", "response_format": {"type": "xml"}}), 400),
        ("POST", "/v1/chat/completions", js({"messages": []}), 400),
        ("POST", "/v1/chat/completions", js({"messages": user, "top_logprobs": 2}), 400),
        ("POST", "/v1/chat/completions", js({"messages": user, "tools": [{}]}), 400),
        ("GET", "/v1/completions", b"", 405),
        ("POST", "/v1/no-such-route", b"{}", 404),
    ]


class Mix:
    """Request i of the soak, drawn from the seed: (kind, path, body, expect)."""

    def __init__(self, seed: int, max_model_len: int, max_tokens: int):
        self.seed = seed
        self.max_tokens = max_tokens
        rng = random.Random(seed)
        # a long prefix (whole KV pages of it are shared), a third of the context
        self.prefix = [rng.randrange(1, 400) for _ in range(max_model_len // 3)]
        self.bad = bad_cases(max_model_len)
        self.kinds = [k for k, w in KINDS.items() for _ in range(w)]

    def text(self, rng: random.Random) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randrange(2, 16)))

    def ids(self, rng: random.Random, lo: int, hi: int) -> list[int]:
        return [rng.randrange(1, 400) for _ in range(rng.randrange(lo, hi))]

    def __call__(self, i: int) -> tuple[str, str, dict | tuple, dict]:
        rng = random.Random(self.seed * 1_000_003 + i)
        kind = rng.choice(self.kinds)
        k = rng.randrange(1, self.max_tokens + 1)
        base = {"max_tokens": k, "ignore_eos": True, "temperature": rng.choice((0, 0.8)),
                "seed": rng.randrange(2 ** 31)}
        expect = {"k": k, "n": 1, "stream": False}
        chat = {"messages": [{"role": "user", "content": self.text(rng)}]}
        if kind == "bad":
            return kind, "", self.bad[rng.randrange(len(self.bad))], {}
        if kind == "cut":
            body = {"prompt": self.text(rng), "max_tokens": CUT_MAX_TOKENS, "ignore_eos": True,
                    "stream": rng.random() < 0.75}
            return kind, "/v1/completions", body, {"after": rng.randrange(1, 4),
                                                   "delay": rng.uniform(0, 0.05)}
        if kind in ("completion", "completion_stream"):
            body = {**base, "prompt": self.text(rng) if rng.random() < 0.5
                    else self.ids(rng, 2, 32)}
            expect["stream"] = kind == "completion_stream"
        elif kind in ("chat", "chat_stream"):
            body = {**base, **chat}
            expect["stream"] = kind == "chat_stream"
        elif kind == "n":
            n = rng.randrange(2, 5)
            body = {**base, "prompt": self.text(rng), "n": n, "temperature": 0.8}
            expect.update(n=n, stream=rng.random() < 0.5)
        elif kind == "logprobs":
            top = rng.randrange(0, 6)
            expect["stream"] = rng.random() < 0.5
            if rng.random() < 0.5:
                body = {**base, "prompt": self.text(rng), "logprobs": top}
                expect["logprobs"] = top
            else:
                body = {**base, **chat, "logprobs": True, "top_logprobs": top}
                expect["top_logprobs"] = top
        elif kind == "prompt_logprobs":
            ids = self.ids(rng, 4, 48)
            body = {**base, "prompt": ids, "prompt_logprobs": rng.randrange(0, 4)}
            expect.update(prompt_tokens=len(ids), prompt_logprobs=True)
        elif kind == "prefix":
            ids = self.prefix + self.ids(rng, 1, 24)
            body = {**base, "prompt": ids}
            expect.update(prompt_tokens=len(ids), stream=rng.random() < 0.5)
        else:  # penalty
            body = {**base, "presence_penalty": rng.uniform(-2, 2),
                    "frequency_penalty": rng.uniform(-2, 2),
                    "repetition_penalty": rng.uniform(0.5, 2.0)}
            if rng.random() < 0.5:
                body.update(chat)
            else:
                body["prompt"] = self.text(rng)
            expect["stream"] = rng.random() < 0.5
        if expect["stream"]:
            body.update(stream=True, stream_options={"include_usage": True})
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        return kind, path, body, expect




def check_body(resp: dict, e: dict) -> list[str]:
    """What is wrong with a non-streamed answer (empty: nothing)."""
    bad = []
    choices = resp.get("choices", [])
    if sorted(c["index"] for c in choices) != list(range(e["n"])):
        bad.append(f"choice indexes {[c['index'] for c in choices]}, n={e['n']}")
    usage = resp.get("usage") or {}
    if usage.get("completion_tokens") != e["n"] * e["k"]:
        bad.append(f"completion_tokens {usage.get('completion_tokens')} != {e['n']}x{e['k']}")
    if "prompt_tokens" in e and usage.get("prompt_tokens") != e["prompt_tokens"]:
        bad.append(f"prompt_tokens {usage.get('prompt_tokens')} != {e['prompt_tokens']}")
    for c in choices:
        if c.get("finish_reason") != "length":
            bad.append(f"finish_reason {c.get('finish_reason')!r}")
        lp = c.get("logprobs")
        if "logprobs" in e:
            if not lp or len(lp["tokens"]) != e["k"] or len(lp["top_logprobs"]) != e["k"]:
                bad.append(f"logprobs of {len((lp or {}).get('tokens', []))} tokens")
            # keyed by text: alternatives that decode alike (say, to U+FFFD) share a key
            elif any(tok not in top or len(top) > e["logprobs"] + 1
                     for tok, top in zip(lp["tokens"], lp["top_logprobs"], strict=True)):
                bad.append("top_logprobs without the sampled token, or too many")
        if "top_logprobs" in e:
            content = (lp or {}).get("content") or []
            if len(content) != e["k"]:
                bad.append(f"chat logprobs of {len(content)} tokens")
            elif any(len(t["top_logprobs"]) != e["top_logprobs"] for t in content):
                bad.append("top_logprobs of the wrong length")
        if e.get("prompt_logprobs"):
            plp = c.get("prompt_logprobs") or []
            if len(plp) != e["prompt_tokens"] or plp[0] is not None or None in plp[1:]:
                bad.append(f"prompt_logprobs of {len(plp)} entries")
    return bad


def check_stream(events: list[str], e: dict) -> list[str]:
    """What is wrong with a streamed answer: one chunk per token per choice, the last one
    with finish_reason "length", then the usage chunk and [DONE]."""
    if not events or events[-1] != "data: [DONE]":
        return [f"stream ends with {events[-1:]!r}"]
    chunks = [json.loads(ev[len("data: "):]) for ev in events[:-1]]
    if any("error" in c for c in chunks):
        return [f"error event {next(c for c in chunks if 'error' in c)}"]
    usage = chunks[-1] if chunks and chunks[-1].get("choices") == [] else None
    tokens = {i: 0 for i in range(e["n"])}
    entries = dict.fromkeys(tokens, 0)
    ends: dict[int, list] = {i: [] for i in tokens}
    bad = []
    for c in chunks[:-1] if usage else chunks:
        if "usage" in c and c["usage"] is not None:
            bad.append("usage in a token chunk")
        for ch in c["choices"]:
            i = ch["index"]
            if i not in tokens:
                return [f"choice index {i}, n={e['n']}"]
            tokens[i] += 1
            ends[i].append(ch.get("finish_reason"))
            lp = ch.get("logprobs")
            entries[i] += len(lp.get("content") or lp.get("tokens") or []) if lp else 0
    for i in tokens:
        if tokens[i] != e["k"]:
            bad.append(f"choice {i}: {tokens[i]} chunks for {e['k']} tokens")
        if ends[i][-1:] != ["length"] or any(ends[i][:-1]):
            bad.append(f"choice {i}: finish reasons {ends[i][-3:]}")
        if ("logprobs" in e or "top_logprobs" in e) and entries[i] != e["k"]:
            bad.append(f"choice {i}: {entries[i]} logprob entries for {e['k']} tokens")
    got = (usage or {}).get("usage") or {}
    if got.get("completion_tokens") != e["n"] * e["k"]:
        bad.append(f"stream usage {got or None}, expected {e['n']}x{e['k']} tokens")
    return bad

