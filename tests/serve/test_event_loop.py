"""Nothing a client sends stalls the event loop, on a real serve.py on
127.0.0.1: 10 MB bodies to every endpoint while a second client polls /health every 20 ms, a
stream that keeps its pace beside a long tokenization, and client templates (refused unless
server.allow_request_templates; then sandboxed, time-bounded, their errors 400s)."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
import unicodedata
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from pipeserve.eventloop.token_bound import NFC_SHRINK, NFKC_SHRINK, byte_chars, char_bound

NO_EOS = {"0": -100, "2": -100}   # <|endoftext|>, <|im_end|> of the tiny tokenizer
# A blocked loop delays /health by the whole blocking call (tokenizing 10 MB: seconds). The bound
# is relative to /health on the same server just before, on the same (possibly busy) machine,
# with a floor far above scheduler noise and far below such a stall.
STALL_FLOOR_S = 1.0
BASELINE_POLLS = 25
TEXT = "hello world "
TEN_MB = 10_000_000
TEMPLATE_FIELD = "chat_template_kwargs.chat_template"


POLLER = """
import json, sys, threading, time, httpx
stop, lat, errors = threading.Event(), [], []
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
with httpx.Client(timeout=30) as c:
    def poll():
        t0 = time.perf_counter()
        try:
            c.get(sys.argv[1] + "/health")
        except httpx.HTTPError as e:
            errors.append(repr(e))
        return time.perf_counter() - t0
    baseline = []
    for _ in range(int(sys.argv[2])):   # the idle server, before the block runs
        baseline.append(poll())
        time.sleep(0.02)
    print("polling", flush=True)
    while not stop.is_set():
        lat.append(poll())
        stop.wait(0.02)
print(json.dumps({"baseline": baseline, "latencies": lat, "errors": errors}), flush=True)
"""


class HealthPoller:
    """GET /health every 20 ms from another process (so this one's GIL and collector never
    delay it): first BASELINE_POLLS on the idle server, then while the block runs; seconds."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.baseline: list[float] = []
        self.latencies: list[float] = []
        self.errors: list[str] = []

    def __enter__(self) -> HealthPoller:
        self.proc = subprocess.Popen([sys.executable, "-c", POLLER, self.base_url,
                                      str(BASELINE_POLLS)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "polling"
        time.sleep(0.1)
        return self

    def __exit__(self, *exc: Any) -> None:
        time.sleep(0.1)
        out, _ = self.proc.communicate("", timeout=60)
        result = json.loads(out.strip().splitlines()[-1])
        self.baseline, self.latencies = result["baseline"], result["latencies"]
        self.errors = result["errors"]

    def check(self, what: str) -> None:
        lat, base = sorted(self.latencies), sorted(self.baseline)
        bound = stall_bound(base)
        print(f"\n/health during {what}: n={len(lat)} worst={lat[-1] * 1e3:.1f} ms; idle: "
              f"median {base[len(base) // 2] * 1e3:.1f} ms, worst {base[-1] * 1e3:.1f} ms; "
              f"bound {bound * 1e3:.0f} ms")
        assert not self.errors, self.errors[:3]
        assert len(lat) >= 5, "the poller hardly ran"
        assert lat[-1] < bound, f"/health took {lat[-1] * 1e3:.0f} ms during {what}"


def stall_bound(idle: list[float]) -> float:
    """What counts as a stall, from samples of the same thing unloaded moments before: on a busy
    machine those are slower too, and the bound grows with them."""
    idle = sorted(idle)
    return max(STALL_FLOOR_S, 50 * idle[len(idle) // 2], 4 * idle[-1])


def post(base_url: str, path: str, body: bytes | dict[str, Any],
         timeout: float = 120) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(base_url + path, content=data, timeout=timeout,
                      headers={"content-type": "application/json", "x-api-key": "none"})


def big_bodies(size: int) -> dict[str, tuple[str, bytes]]:
    text = TEXT * (size // len(TEXT))
    chat = [{"role": "user", "content": text}]
    bodies = {
        "chat": ("/v1/chat/completions", {"model": "tiny", "messages": chat, "max_tokens": 2}),
        "completions": ("/v1/completions", {"model": "tiny", "prompt": text, "max_tokens": 2}),
        "count_tokens": ("/v1/messages/count_tokens", {"model": "tiny", "messages": chat}),
        "messages": ("/v1/messages", {"model": "tiny", "messages": chat, "max_tokens": 2}),
        "responses": ("/v1/responses", {"model": "tiny", "input": text, "max_output_tokens": 2})}
    return {k: (path, json.dumps(b).encode()) for k, (path, b) in bodies.items()}


def error_of(r: httpx.Response) -> dict[str, Any]:
    """The error object of either protocol's error body."""
    return r.json()["error"]


@pytest.fixture(scope="module")
def srv(server_factory: Any) -> Any:
    return server_factory()


@pytest.fixture(scope="module")
def open_srv(server_factory: Any) -> Any:
    """Request templates on (1 s bound) and a context long enough that a 1.5 MB prompt passes
    the character bound, so it really is tokenized (for seconds) before it is refused."""
    return server_factory("server.allow_request_templates=true",
                          "server.request_template_timeout_s=1", "model.max_context=400000")


# -- 10 MB bodies ----------------------------------------------------------------------------
def test_ten_mb_bodies_are_refused_before_tokenizing_and_health_stays_fast(srv: Any) -> None:
    bodies = big_bodies(TEN_MB)
    with HealthPoller(srv.base_url) as poller:
        for name, (path, data) in bodies.items():
            assert len(data) >= TEN_MB
            r = post(srv.base_url, path, data)
            assert r.status_code == 400, (name, r.text[:300])
            err = error_of(r)
            # "at least": refused by the character bound, before any tokenizing (a count would
            # give the exact number, after 5-20 s of tokenizer time here)
            assert "at least" in err["message"] and "context limit is 4096" in err["message"], err
            if not path.startswith("/v1/messages"):
                assert err["param"] == ("prompt" if name == "completions" else "messages"), err
                assert err["code"] == "context_length_exceeded"
    poller.check("five 10 MB bodies")
    assert httpx.get(srv.base_url + "/health").status_code == 200


def test_long_tokenization_runs_off_the_loop_beside_a_stream(open_srv: Any) -> None:
    """1.5 MB prompts pass the character bound at max_context 400000 and are tokenized (Rust,
    on the preparation pool) before the count refuses them; a stream beside them keeps going."""
    bodies = big_bodies(1_500_000)
    arrivals: list[float] = []
    streamed, done = threading.Event(), threading.Event()

    def stream() -> None:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4000, "temperature": 0,
                "logit_bias": NO_EOS, "stream": True}
        with httpx.stream("POST", open_srv.base_url + "/v1/completions", json=body,
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.perf_counter())
                    streamed.set()
                if done.is_set():
                    return   # leaving closes the connection: the server aborts the stream
    with HealthPoller(open_srv.base_url) as poller:
        th = threading.Thread(target=stream, daemon=True)
        th.start()
        assert streamed.wait(60), "the stream never started"
        for _ in range(600):   # its pace alone, before the prompts (bounded: 60 s)
            if len(arrivals) > 20:
                break
            time.sleep(0.1)
        alone = list(arrivals)
        t0 = time.perf_counter()
        for name in ("chat", "completions", "count_tokens"):
            path, data = bodies[name]
            r = post(open_srv.base_url, path, data)
            assert r.status_code == 400, (name, r.text[:300])
            msg = error_of(r)["message"]
            assert "tokens; the context limit is 400000" in msg, msg
        t1 = time.perf_counter()
        done.set()
        th.join(60)
    poller.check(f"tokenizing three 1.5 MB prompts ({t1 - t0:.1f} s)")
    during = [t for t in arrivals if t0 <= t <= t1]
    gaps = [b - a for a, b in zip(during, during[1:])] or [t1 - t0]
    bound = stall_bound([b - a for a, b in zip(alone, alone[1:])])
    print(f"stream: {len(during)} tokens while the prompts were prepared ({t1 - t0:.1f} s), "
          f"worst gap {max(gaps) * 1e3:.0f} ms (bound {bound * 1e3:.0f} ms)")
    assert len(during) >= 20, "the stream hardly moved while the big prompts were prepared"
    assert max(gaps) < bound, f"the stream stalled {max(gaps):.2f} s"


def test_count_tokens_of_a_large_prompt_within_the_context(open_srv: Any,
                                                           tiny_tokenizer: Tokenizer) -> None:
    big, small = TEXT * 20_000, TEXT   # 240 kB: rendered and counted on the preparation pool
    counts = [post(open_srv.base_url, "/v1/messages/count_tokens",
                   {"model": "tiny", "messages": [{"role": "user", "content": t}]})
              for t in (big, small)]
    assert [c.status_code for c in counts] == [200, 200], counts[0].text[:300]
    n_big, n_small = (c.json()["input_tokens"] for c in counts)
    # the same template around each: the difference is the texts' own token counts
    assert n_big - n_small == (len(tiny_tokenizer.encode(big).ids)
                               - len(tiny_tokenizer.encode(small).ids))


# -- client templates ----------------------------------------------------------------------
CHAT = [{"role": "user", "content": "hi"}]


def test_request_template_is_refused_by_default(srv: Any) -> None:
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 2,
            "chat_template_kwargs": {"chat_template": "X"}}
    r = post(srv.base_url, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == TEMPLATE_FIELD and "allow_request_templates" in err["message"], err
    r = post(srv.base_url, "/v1/messages", body)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert TEMPLATE_FIELD in error_of(r)["message"]
    r = post(srv.base_url, "/v1/messages/count_tokens", body)
    assert r.status_code == 400 and TEMPLATE_FIELD in error_of(r)["message"], r.text
    r = post(srv.base_url, "/v1/responses", {"model": "tiny", "input": "hi",
                                             "chat_template_kwargs": {"chat_template": "X"}})
    assert r.status_code == 400 and error_of(r)["param"] == TEMPLATE_FIELD, r.text


def test_template_variables_are_accepted_and_call_parameters_refused(srv: Any) -> None:
    ok = post(srv.base_url, "/v1/chat/completions",
              {"model": "tiny", "messages": CHAT, "max_tokens": 2,
               "chat_template_kwargs": {"enable_thinking": False, "custom_flag": 3}})
    assert ok.status_code == 200, ok.text
    r = post(srv.base_url, "/v1/chat/completions",
             {"model": "tiny", "messages": CHAT, "max_tokens": 2,
              "chat_template_kwargs": {"tokenize": True}})
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == "chat_template_kwargs.tokenize", r.text


def count(base_url: str, template: str, messages: list[dict[str, Any]] = CHAT) -> httpx.Response:
    return post(base_url, "/v1/messages/count_tokens",
                {"model": "tiny", "messages": messages,
                 "chat_template_kwargs": {"chat_template": template}})


def test_allowed_request_template_renders_the_prompt(open_srv: Any) -> None:
    r = post(open_srv.base_url, "/v1/completions",
             {"model": "tiny", "prompt": TEXT * 3, "max_tokens": 1})
    plain = r.json()["usage"]["prompt_tokens"]
    body = {"model": "tiny", "max_tokens": 1,
            "messages": [{"role": "user", "content": TEXT * 3}],
            "chat_template_kwargs": {"chat_template": "{{ messages[0].content }}"}}
    r = post(open_srv.base_url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    # the prompt is exactly what the request's template wrote: the bare text
    assert r.json()["usage"]["prompt_tokens"] == plain
    loops = "{% for m in messages %}{% generation %}{{ m.role }}{% endgeneration %}{% endfor %}"
    assert count(open_srv.base_url, loops).status_code == 200


@pytest.mark.parametrize("template, words", [
    ("{{ range(100001)|list }}", "sandbox limit"),
    ("{% for m in messages %}{{ m.content }", "does not compile"),
    ("{{ raise_exception('no system role') }}", "no system role"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", None),
    ("{{ 'x' * 3000000000 }}", "MiB"),
    ("{% set n = 7 ** 300000000 %}{{ n }}", "within 1 s"),   # one C call: killed, not timed
])
def test_request_template_errors_are_400s_naming_the_field(open_srv: Any, template: str,
                                                           words: str | None) -> None:
    r = count(open_srv.base_url, template)
    assert r.status_code == 400, r.text
    msg = error_of(r)["message"]
    assert msg.startswith(TEMPLATE_FIELD), msg
    if words is not None:
        assert words in msg, msg


def test_slow_request_template_is_cut_off_and_health_stays_fast(open_srv: Any) -> None:
    slow = ("{% for i in range(20000) %}{% for j in range(20000) %}{% endfor %}{% endfor %}"
            "{{ messages[0].content }}")
    with HealthPoller(open_srv.base_url) as poller:   # 4e8 loop steps: hours, uncut
        r = post(open_srv.base_url, "/v1/chat/completions",
                 {"model": "tiny", "messages": CHAT, "max_tokens": 2,
                  "chat_template_kwargs": {"chat_template": slow}})
    poller.check("a slow request template")
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == TEMPLATE_FIELD and "within 1 s" in err["message"], err
    ok = post(open_srv.base_url, "/v1/chat/completions",
              {"model": "tiny", "messages": CHAT, "max_tokens": 2})
    assert ok.status_code == 200


# -- the character bound, no server ----------------------------------------------------------
def test_composition_constants_match_unicodedata() -> None:
    """NFC/NFKC turn at most this many characters into one (the longest NFD/NFKD expansion)."""
    longest = {"NFD": 1, "NFKD": 1}
    for cp in range(sys.maxunicode + 1):
        ch = chr(cp)
        if unicodedata.decomposition(ch):
            for form in longest:
                longest[form] = max(longest[form], len(unicodedata.normalize(form, ch)))
    assert (longest["NFD"], longest["NFKD"]) == (NFC_SHRINK, NFKC_SHRINK)


@pytest.fixture(scope="module")
def tiny_tokenizer(model_cache: Any, srv: Any) -> Tokenizer:
    paths = list(model_cache.glob("*/tokenizer.json"))
    assert paths, "the tiny model was not generated"
    return Tokenizer.from_file(str(paths[0]))


def test_bound_never_exceeds_the_real_count(tiny_tokenizer: Tokenizer) -> None:
    bound = char_bound(tiny_tokenizer)
    assert bound is not None and bound.max_token_chars >= 8
    rng = random.Random(15)
    vocab = list(tiny_tokenizer.get_vocab(with_added_tokens=True))
    for _ in range(300):
        # text made of the vocabulary's longest pieces, the worst case for the bound
        pieces = sorted(vocab, key=len)[-40:] + ["é", "🙂", " ", "\n", "<|im_start|>"]
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 200)))
        assert bound.min_tokens(text) <= len(tiny_tokenizer.encode(text).ids), text


def _without_bytes(tok: Tokenizer, drop: set[int]) -> Tokenizer:
    """`tok` (byte-level BPE) with these bytes' characters gone from its vocabulary, as in
    vocabularies converted from GGUF (SmolLM2's lacks 0x04, 0x06, 0x13, 0x14, 0x16, 0x1d, 0xf1,
    0xf2): the tokenizer then skips every character that contains one."""
    spec = json.loads(tok.to_str())
    gone = {byte_chars()[b] for b in drop}
    model = spec["model"]
    model["vocab"] = {t: i for t, i in model["vocab"].items() if not gone & set(t)}
    model["merges"] = [m for m in model["merges"]
                       if not gone & set("".join(m) if isinstance(m, list) else m)]
    return Tokenizer.from_str(json.dumps(spec))


def test_bound_skips_characters_a_byte_level_vocabulary_lacks(tiny_tokenizer: Tokenizer) -> None:
    tok = _without_bytes(tiny_tokenizer, {0x04, 0xF1})
    bound = char_bound(tok)
    assert bound is not None and bound.dropped_bytes == {0x04, 0xF1}
    for text in ("\x04" * 5000, chr(0x50000) * 5000, "ab\x04" * 3000, "hello world " * 900):
        assert bound.min_tokens(text) <= len(tok.encode(text).ids), repr(text[:9])
    assert len(tok.encode("\x04" * 5000).ids) == 0   # why they must not count
    assert bound.min_tokens("hello world " * 900) == 10800 // bound.max_token_chars
    # a continuation byte missing: nearly any non-ASCII character could vanish, so no bound
    assert char_bound(_without_bytes(tiny_tokenizer, {0x85})) is None


def _tokenizer(normalizer: Any = None, pre: Any = None, **bpe: Any) -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "<unk>": 2}, merges=[], **bpe))
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre is not None:
        tok.pre_tokenizer = pre
    return tok


@pytest.mark.parametrize("tok, sound", [
    (_tokenizer(unk_token="<unk>", fuse_unk=False), True),
    (_tokenizer(unk_token="<unk>", fuse_unk=True), False),        # a run of unknowns → 1 token
    (_tokenizer(), False),                                         # unknowns dropped
    (_tokenizer(byte_fallback=True), True),
    (_tokenizer(normalizers.Strip(), byte_fallback=True), False),  # deletes text
    (_tokenizer(normalizers.NFC(), byte_fallback=True), True),
    (_tokenizer(pre=pre_tokenizers.Whitespace(), byte_fallback=True), False),
    (_tokenizer(pre=pre_tokenizers.Metaspace(), byte_fallback=True), True),
])
def test_bound_only_where_it_is_sound(tok: Tokenizer, sound: bool) -> None:
    assert (char_bound(tok) is not None) == sound


def test_nfc_bound_is_looser_for_non_ascii() -> None:
    bound = char_bound(_tokenizer(normalizers.NFC(), byte_fallback=True))
    assert bound is not None
    assert bound.min_tokens("a" * 4000) == 4000 // bound.max_token_chars
    assert bound.min_tokens("é" * 4000) == 4000 // (bound.max_token_chars * NFC_SHRINK)


def test_a_queued_stream_gets_keep_alives_then_its_tokens(server_factory: Any) -> None:
    """A stream whose request waits behind another (one row at a time) receives SSE keep-alive
    comments every server.keep_alive_s until its first token, then streams normally."""
    s = server_factory("scheduler=serial", "server.keep_alive_s=0.2")
    url = f"{s.base_url}/v1/completions"

    def body(n: int) -> dict[str, Any]:
        return {"model": "tiny", "prompt": "hello world", "max_tokens": n, "stream": True,
                "temperature": 0, "logit_bias": NO_EOS}

    lines: dict[str, list[str]] = {}

    def read(name: str, n: int) -> None:
        with httpx.Client(timeout=120) as c, c.stream("POST", url, json=body(n)) as r:
            assert r.status_code == 200
            # every event's `id:` line (resumable streams) aside: comments and data in order
            lines[name] = [ln for ln in r.iter_lines() if ln and not ln.startswith("id: ")]

    first = threading.Thread(target=read, args=("first", 4000))
    first.start()
    deadline = time.monotonic() + 30   # the long request holds the only row before the next
    while time.monotonic() < deadline and "pipeserve_active_rows 1.0" not in httpx.get(
            f"{s.base_url}/metrics").text:
        time.sleep(0.02)
    read("queued", 8)
    first.join(120)
    queued, running = lines["queued"], lines["first"]
    first_data = next(i for i, ln in enumerate(queued) if ln.startswith("data: "))
    assert first_data >= 2 and all(ln == ": keep-alive" for ln in queued[:first_data])
    tokens = [json.loads(ln[6:]) for ln in queued if ln.startswith("data: {")]
    assert sum(1 for t in tokens for c in t["choices"] if c.get("text")) == 8
    assert queued[-1] == "data: [DONE]" and running[-1] == "data: [DONE]"
