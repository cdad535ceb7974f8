"""The server and its clients under bad input (issue #15): a body shorter than its Content-Length, clients that
vanish mid-request, an invalid --port, a malformed server address. Raw sockets on 127.0.0.1."""

from __future__ import annotations

import io
import json
import logging
import socket
import struct
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
import torch
from test_server import CFG  # the same tiny model as the server's functional tests

from megatron.model import GPTModel
from megatron.mpu.context import ParallelContext
from megatron.text_generation import TextGenerator
from megatron.text_generation.server import make_server
from megatron.tokenizer import build_tokenizer
from tools import run_text_generation_server, text_generation_cli

READ_TIMEOUT = 1.0


@pytest.fixture(autouse=True)
def _no_stale_log_handlers() -> Iterator[None]:
    """Tools run in-process by earlier tests (``main()`` calls ``setup_logging``) leave a root handler on a
    captured, since closed, stderr; logging through it prints "--- Logging error ---" tracebacks."""
    root = logging.getLogger()
    stale = [h for h in root.handlers if getattr(h, "_trident", False)]
    for h in stale:
        root.removeHandler(h)
    yield
    for h in stale:
        root.addHandler(h)


@pytest.fixture(scope="module")
def address() -> Iterator[tuple[str, int]]:
    tok = build_tokenizer(tokenizer_type="NullTokenizer", vocab_size=59)
    gen = TextGenerator(
        GPTModel(CFG, ParallelContext(seed=4)).eval(), CFG, tok, torch.device("cpu")
    )
    # One prompt per batch: a 48-prompt request generates long enough to be reset meanwhile.
    server = make_server(gen, "127.0.0.1", 0, read_timeout=READ_TIMEOUT, max_batch_size=1)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[:2]
    server.shutdown()
    server.server_close()


def _connect(address: tuple[str, int]) -> socket.socket:
    s = socket.create_connection(address, timeout=READ_TIMEOUT + 10)
    return s


def _reset(s: socket.socket) -> None:
    """Close with SO_LINGER 0: the peer sees a TCP RST (ConnectionResetError / BrokenPipeError)."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def _answer(s: socket.socket) -> bytes:
    """Everything the server sends until it closes (the test's own timeout: READ_TIMEOUT + 10 s)."""
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def _generate_ok(address: tuple[str, int]) -> None:
    body = json.dumps({"prompts": ["1 2"], "tokens_to_generate": 3, "top_k": 1}).encode()
    host, port = address
    req = urllib.request.Request(f"http://{host}:{port}/api", data=body, method="PUT")
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200 and len(json.loads(resp.read())["tokens"][0]) == 3


def _health(address: tuple[str, int]) -> dict:
    host, port = address
    with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=30) as resp:
        return json.loads(resp.read())


def _records(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "megatron.text_generation.server"]


def test_short_body_and_silent_client_time_out(address, caplog, capfd) -> None:
    caplog.set_level(logging.INFO, logger="megatron.text_generation.server")
    # Headers promise 100 bytes, 11 arrive, then nothing: 408 after the read timeout, not a worker blocked forever.
    s = _connect(address)
    s.sendall(b'PUT /api HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"prompts":')
    start = time.monotonic()
    answer = _answer(s)
    took = time.monotonic() - start
    s.close()
    assert answer.startswith(b"HTTP/1.0 408"), answer
    assert b"Content-Length" in answer and b"100" in answer.split(b"\r\n\r\n", 1)[1]
    assert READ_TIMEOUT * 0.9 <= took < READ_TIMEOUT + 5, took
    # A client that connects and sends nothing is closed after the read timeout too.
    s = _connect(address)
    start = time.monotonic()
    assert _answer(s) == b""
    assert time.monotonic() - start < READ_TIMEOUT + 5
    s.close()
    # A body cut short by the client (half-close): 400 naming the byte counts, at once.
    s = _connect(address)
    s.sendall(b"PUT /api HTTP/1.0\r\nContent-Length: 50\r\n\r\n{}")
    s.shutdown(socket.SHUT_WR)
    answer = _answer(s)
    s.close()
    assert answer.startswith(b"HTTP/1.0 400") and b"2 of the 50 bytes" in answer, answer
    _generate_ok(address)  # still serving
    logs = _records(caplog)
    assert any("408" in m or "timed out" in m for m in logs), logs
    assert all("\n" not in m for m in logs), logs
    assert "Traceback" not in capfd.readouterr().err


def test_client_disconnects_are_one_line(address, caplog, capfd) -> None:
    caplog.set_level(logging.INFO, logger="megatron.text_generation.server")
    # Reset while the server reads the body...
    s = _connect(address)
    s.sendall(b'PUT /api HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"prompts":')
    time.sleep(0.2)
    _reset(s)
    # ...and after a full request, while it generates (about 1.5 s): the answer meets a reset socket.
    body = json.dumps(
        {"prompts": ["1"] * 48, "tokens_to_generate": 30, "stop_at_eod": False}
    ).encode()
    s = _connect(address)
    s.sendall(b"PUT /api HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = (
        time.monotonic() + 10
    )  # the server reads it and starts generating (one prompt per batch)
    while _health(address)["in_flight"] != 1:
        assert time.monotonic() < deadline, "the request never started generating"
        time.sleep(0.01)
    _reset(s)
    # Still serving (this request is queued behind the dropped one's prompts).
    _generate_ok(address)
    time.sleep(0.2)
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    logs = _records(caplog)
    assert any("disconnected while its request was read" in m for m in logs), logs
    assert any("disconnected while its answer was sent" in m for m in logs), logs
    assert all("\n" not in m for m in logs), logs


@pytest.mark.parametrize("port", ["70000", "-1", "65536"])
def test_invalid_port_is_one_line(port, tmp_path, capsys) -> None:
    # Checked before the checkpoint is opened: the port is named even though --load is empty too.
    assert run_text_generation_server.main(["--load", str(tmp_path), "--port", port]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"--port {port}" in err and "0..65535" in err, err


@pytest.mark.parametrize(
    "address",
    ["localhost:abc", "h ost:5000", "http://[::1", "ftp://host:5000", "localhost:99999", ""],
)
def test_malformed_url_is_one_line(address, monkeypatch, capsys) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("1 2\n"))
    assert text_generation_cli.main([address]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and err.count("\n") == 0, err
    assert "host:port" in err, err
