"""The server's way in: a prompt is sized before it is tokenized (one that cannot fit is refused
unread, so a huge one never stalls the other streams), a long one is tokenized off the event
loop, a request counts against the capacity before its prompt is tokenized, text UTF-8 cannot
encode is a 400 that says so, the errors name the field at fault, and the API key's scheme is
case-insensitive. Servers as in test_server.py: the 9M model in-process on a loopback port."""

import json
import os
import threading
import time

import httpx
import pytest

from selfspec.serving.openai_api import service as service_module
from selfspec.serving.openai_api.prompt_size import text_bytes_per_token

from conftest import SHIPPED
from test_server import LONG, MODEL, model_tok, own_server, server, stream_in_thread, wait_for  # noqa: F401

BIG = int(3.8 * 2**20)  # bytes of text: the body stays under the 4 MiB limit


def post(srv, body, path="/v1/completions", **kw):
    return httpx.post(srv.url + path, json={"model": MODEL, **body}, timeout=60, **kw)


def refuse_tokenizing(monkeypatch):
    """Fails the request (a 400 the test will not expect) if its prompt gets tokenized."""
    def refuse(tok, prompt):
        raise AssertionError("the prompt was tokenized")

    monkeypatch.setattr(service_module, "encode_prompt", refuse)


# -- the size bound ------------------------------------------------------------------------------
def test_the_bound_is_sound_for_the_shipped_tokenizer(model_tok):
    """No token stands for more than K bytes of text, so a text of B bytes has at least B / K tokens."""
    _, tok = model_tok
    k = text_bytes_per_token(tok)
    assert k is not None and k >= max(len(tok.decode([i]).encode()) for i in range(len(tok)))
    with open(os.path.join(SHIPPED, "prompts.jsonl")) as f:
        texts = [json.loads(line)["prompt"] for line in f] + [" " * 5000, "\n" * 3000, "é" * 999, "a" * 777]
    for text in texts:
        assert len(tok.encode(text)) * k >= len(text.encode())


def test_a_tokenizer_that_folds_whitespace_gets_no_bound(model_tok):
    """Folding makes a token stand for more text than its piece holds: no bound is sound then."""
    _, tok = model_tok

    class Folding(type(tok)):
        def encode(self, text, **kw):
            return super().encode(" ".join(text.split()), **kw)

    assert text_bytes_per_token(Folding(tok.model_file)) is None


def test_a_prompt_over_what_the_context_can_hold_is_refused_unread(own_server, monkeypatch):
    srv = own_server()
    most = srv.service.max_prompt_bytes
    assert most == text_bytes_per_token(srv.service.tok) * srv.service.max_prompt_tokens
    refuse_tokenizing(monkeypatch)
    for body, path in [({"prompt": "a" * (most + 1)}, "/v1/completions"),
                       ({"messages": [{"role": "user", "content": "é" * (most // 2 + 1)}]}, "/v1/chat/completions")]:
        r = post(srv, body, path)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert f"{most:,} bytes" in r.json()["error"]["message"]
    r = post(srv, {"prompt": "a" * most})  # at the bound: tokenized (and refused by its count)
    assert r.status_code == 400 and "was tokenized" in r.json()["error"]["message"]


def test_a_huge_prompt_does_not_stall_another_stream(own_server):
    """One client streams while another sends 3.8 MiB of text: refused at once, and the stream's
    longest gap between events stays under 0.25 s."""
    srv = own_server()
    text = ("y = f(x) + 1; " * (BIG // 14 + 1))[:BIG]
    body = json.dumps({"model": MODEL, "prompt": text}).encode()
    assert len(body) < 4 << 20
    log = []
    streaming = stream_in_thread(srv.client(), LONG, 400, log)
    wait_for(lambda: len(log) >= 3, "the stream's first events")
    sent = time.perf_counter()
    r = httpx.post(srv.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"},
                   timeout=60)
    answered = time.perf_counter()
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    streaming.join(60)
    times = [t for t, _, _ in log]
    assert log[-1][2] == "length" and times[-1] > answered + 0.1, "the stream ended before the huge request did"
    around = [t for t in times if sent - 0.5 <= t <= answered + 0.5]
    gap = max(b - a for a, b in zip(around, around[1:]))
    assert gap < 0.25, f"the stream stalled {gap:.2f} s while a 3.8 MiB prompt was refused in {answered - sent:.2f} s"


# -- admission before tokenizing ---------------------------------------------------------------
def test_a_request_counts_against_the_capacity_while_its_prompt_is_tokenized(own_server, monkeypatch):
    srv = own_server(max_batch=1, max_queue=0)
    entered, release, real = threading.Event(), threading.Event(), service_module.encode_prompt

    def slow(tok, prompt):
        if len(prompt) > service_module.INLINE_BYTES:
            entered.set()
            release.wait(30)
        return real(tok, prompt)

    monkeypatch.setattr(service_module, "encode_prompt", slow)
    first = {}
    long_text = "x = 1" + " " * 5000  # over INLINE_BYTES (tokenized in the worker thread), ~320 tokens
    t = threading.Thread(target=lambda: first.setdefault("r", post(srv, {"prompt": long_text, "max_tokens": 2})))
    t.start()
    assert entered.wait(30)
    assert httpx.get(srv.url + "/health", timeout=5).status_code == 200  # the loop is not the one tokenizing
    r = post(srv, {"prompt": "a", "max_tokens": 2})  # the first one holds the only slot while it is tokenized
    release.set()
    t.join(60)
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    assert first["r"].status_code == 200, first["r"].text


def test_a_full_server_refuses_before_tokenizing(own_server, monkeypatch):
    srv = own_server(max_batch=1, max_queue=0)
    log = []
    stream_in_thread(srv.client(), LONG, 300, log)
    wait_for(lambda: log, "the running request's first token")
    refuse_tokenizing(monkeypatch)
    r = post(srv, {"prompt": "a", "max_tokens": 2})
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"


# -- what the errors say ---------------------------------------------------------------------------
@pytest.mark.parametrize("raw, path, param", [
    (b'{"prompt": "a\\ud800b"}', "/v1/completions", "prompt"),
    (b'{"prompt": ["\\udfff"]}', "/v1/completions", "prompt"),
    (b'{"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "x\\udc80"}]}',
     "/v1/chat/completions", "messages[1].content"),
])
def test_a_prompt_with_a_lone_surrogate_is_a_400_that_says_it_cannot_be_encoded(server, raw, path, param):
    body = raw[:1] + b'"model": "%s", ' % MODEL.encode() + raw[1:]
    r = httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and err["code"] == "invalid_prompt", r.text
    assert "cannot be encoded" in err["message"] and "lone surrogate" in err["message"]


@pytest.mark.parametrize("body, path, param", [
    ({"prompt": "a", "max_tokens": 10**9}, "/v1/completions", "max_tokens"),
    ({"messages": [{"role": "user", "content": "a"}], "max_tokens": 10**9}, "/v1/chat/completions", "max_tokens"),
    ({"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 10**9}, "/v1/chat/completions",
     "max_completion_tokens"),
    ({"prompt": [5] * 5000, "max_tokens": 8}, "/v1/completions", "prompt"),  # the prompt alone is over
    ({"prompt": [5] * 5000}, "/v1/completions", "prompt"),
])
def test_the_context_error_names_the_field_that_is_over(server, body, path, param):
    r = post(server, body, path)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == param, r.text


def test_the_context_error_of_a_max_context_server_names_max_tokens_too(own_server):
    srv = own_server(max_context=64)
    r = post(srv, {"prompt": "a", "max_tokens": 100})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


AUTH = [("Bearer sekrit", 200), ("bearer sekrit", 200), ("BEARER sekrit", 200), ("bEaReR  sekrit", 200),
        ("Basic sekrit", 401), ("bearer wrong", 401), ("bearersekrit", 401), ("sekrit", 401), ("bearer", 401),
        ("", 401)]


def test_the_api_key_scheme_is_case_insensitive(own_server):
    srv = own_server(api_key="sekrit")
    got = [(h, httpx.get(srv.url + "/v1/models", headers={"Authorization": h}).status_code) for h, _ in AUTH]
    assert got == AUTH
