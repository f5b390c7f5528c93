"""A client that stops reading its stream cannot keep its seat and compute.

Real servers on 127.0.0.1 (uvicorn in a thread, the tiny random-weight model); the stalled
client is a raw socket with a small receive buffer that sends a streaming request and then
reads nothing, so the server's writes block after a few kilobytes.  What must hold:

- the request is paused (`tokenloom:num_requests_paused`): out of the batch, KV kept;
- another client is served meanwhile;
- when the client reads again the request resumes, and the whole stream is exactly what an
  unpaused greedy run of the same request gives (n = 1 and n = 2);
- a client stalled past --stalled-stream-timeout has its request aborted, KV freed, and reads
  a `stream_stalled` error event if it ever reads again.
"""

from __future__ import annotations

import http.client
import json
import socket
from pathlib import Path

import httpx
import pytest

from server_fixtures import ThreadedServer, allow_context, make_tiny_model, metric, sse_events, wait_until
from tokenloom.bench.launcher import free_port

NAME = "tiny"
PAUSED = "tokenloom:num_requests_paused"
WAIT = 180  # generous: two shared cores, other tests running


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return allow_context(make_tiny_model(tmp_path_factory.mktemp("stall") / "tiny"), 16384)


def _server(model_dir: Path, timeout: float) -> ThreadedServer:
    return ThreadedServer([str(model_dir), "--port", str(free_port()), "--max-model-len", "4096",
                           "--num-kv-blocks", "1100", "--seed", "0", "--served-model-name", NAME,
                           "--max-unread-stream-tokens", "16", "--stalled-stream-timeout", str(timeout),
                           "--max-unsent-bytes", "4096", "--log-level", "critical", "--disable-access-log"]).start()


@pytest.fixture(scope="module")
def patient(model_dir: Path):
    """Pauses stalled streams and never gives up on them within a test."""
    srv = _server(model_dir, 3600)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def impatient(model_dir: Path, patient):
    """Aborts a stream paused for more than 1.5 s."""
    srv = _server(model_dir, 1.5)
    yield srv
    srv.stop()


def _body(n: int = 1, max_tokens: int = 1500) -> dict:
    return {"model": NAME, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "n": n,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def _stalled_client(base_url: str, body: dict) -> socket.socket:
    """Send a streaming request over a socket with a tiny receive buffer, and read nothing."""
    port = int(base_url.rsplit(":", 1)[1])
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: sets the window
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return s


def _read_events(s: socket.socket) -> list:
    """Start reading at last: the HTTP response (chunked) to its end, as SSE events."""
    s.settimeout(WAIT)
    resp = http.client.HTTPResponse(s)
    resp.begin()
    assert resp.status == 200
    text = resp.read().decode()
    s.close()
    return sse_events(text.splitlines())


def _stream(base_url: str, body: dict) -> list:
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=WAIT) as r:
        assert r.status_code == 200
        return sse_events(r.iter_lines())


def _texts(events: list) -> tuple[dict[int, str], dict[int, str], dict]:
    """Text and finish reason per choice index, and the usage, of a completion stream."""
    assert events[-1] == "[DONE]"
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = {}
    for e in events[:-1]:
        assert "error" not in e, e
        if e.get("usage"):
            usage = e["usage"]
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"] is not None:
                reasons[c["index"]] = c["finish_reason"]
    return texts, reasons, usage


def _kv(url: str) -> float:
    return metric(url, "tokenloom:kv_cache_usage_perc")


@pytest.mark.parametrize("n", [1, 2])
def test_a_stalled_stream_is_paused_keeps_its_kv_and_resumes_intact(patient, n):
    url = patient.base_url
    reference = _texts(_stream(url, _body(n)))  # the same request, read as it comes
    assert reference[1] == dict.fromkeys(range(n), "length") and reference[2]["completion_tokens"] == 1500 * n
    pauses = metric(url, "tokenloom:num_stream_pauses_total")

    s = _stalled_client(url, _body(n))
    try:
        assert wait_until(lambda: metric(url, PAUSED) == n, WAIT), "the stalled stream was never paused"
        # out of the batch, its KV kept
        assert metric(url, "tokenloom:num_requests_running") == 0
        kv = _kv(url)
        assert kv > 0
        # someone else is served meanwhile, and the stalled request stays paused with its KV
        other = _texts(_stream(url, _body(1, max_tokens=40)))
        assert other[1] == {0: "length"} and other[2]["completion_tokens"] == 40
        assert metric(url, PAUSED) == n and _kv(url) == pytest.approx(kv)

        events = _read_events(s)  # the client reads again: the request resumes and finishes
    finally:
        s.close()
    assert _texts(events) == reference
    assert metric(url, "tokenloom:num_stream_pauses_total") >= pauses + 1
    assert wait_until(lambda: metric(url, PAUSED) == 0 and _kv(url) == 0, WAIT)


def test_a_reader_stalled_past_the_timeout_is_aborted_and_its_kv_freed(impatient):
    url = impatient.base_url
    s = _stalled_client(url, _body(2, max_tokens=3000))
    try:
        assert wait_until(lambda: metric(url, "tokenloom:num_stalled_stream_aborts_total") == 1, WAIT), \
            "the stalled stream was never aborted"
        assert wait_until(lambda: _kv(url) == 0, WAIT)
        assert metric(url, PAUSED) == 0 and metric(url, "tokenloom:num_requests_running") == 0
        assert metric(url, "tokenloom:request_success_total", finished_reason="abort") == 2  # both samples
        # the others are unaffected
        other = _texts(_stream(url, _body(1, max_tokens=40)))
        assert other[1] == {0: "length"} and other[2]["completion_tokens"] == 40
        # reading at last: what was produced, then the reason it ended
        events = _read_events(s)
    finally:
        s.close()
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == "stream_stalled" and "--stalled-stream-timeout" in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}
    assert sum(len(c["text"]) for e in events[:-2] for c in e.get("choices", [])) > 0
    assert _kv(url) == 0
