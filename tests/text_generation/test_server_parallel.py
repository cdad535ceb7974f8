"""The batched server under load and at TP/PP > 1: real sockets on 127.0.0.1, real processes, no mocks.

- 50 concurrent clients against an in-process server with a small queue: every answer is the prompt's greedy
  answer generated alone, or a 503 (queue full); malformed requests get 400; the server keeps serving.
- The queue bound, deterministically: prompts wait while no scheduler runs, the next request is a 503.
- ``tools/run_text_generation_server.py`` as a subprocess (one process, torchrun TP = 2, torchrun PP = 2) on a
  checkpoint trained at TP = 2 in the test: answers equal the one-process generator's, it keeps serving across
  idle heartbeats, and SIGTERM to rank 0 stops every process with exit code 0.
"""

from __future__ import annotations

import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from test_server import CFG  # the tiny model of the server's functional tests

from megatron.model import GPTModel
from megatron.mpu.context import ParallelContext
from megatron.testing import run_distributed
from megatron.text_generation import PromptRequest, SamplingParams, TextGenerator, prompt_seed
from megatron.text_generation.server import make_server
from megatron.tokenizer import build_tokenizer

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["1 2 3", "40", "7 7 7 7 7", "12 5", "58 0 3 9", "33", "21 22 23 24 25 26", "9 9"]
BAD = [
    b"{not json",
    b'{"prompts": []}',
    b'{"prompts": ["1"], "top_k": 2, "top_p": 0.5}',
    b'{"prompts": ["1"], "tokens_to_generate": 40}',
]
NEW = 4


def _put(url: str, data: bytes, timeout: float = 60) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=data, method="PUT")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _get(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return json.loads(err.read())


def _greedy(prompts: list[str], new: int = NEW, **extra: Any) -> bytes:
    body = {"prompts": prompts, "tokens_to_generate": new, "top_k": 1, "stop_at_eod": False}
    return json.dumps({**body, **extra}).encode()


@pytest.fixture(scope="module")
def gen() -> TextGenerator:
    tok = build_tokenizer(tokenizer_type="NullTokenizer", vocab_size=59)
    return TextGenerator(
        GPTModel(CFG, ParallelContext(seed=4)).eval(), CFG, tok, torch.device("cpu")
    )


def _alone(gen: TextGenerator, prompt: str, new: int = NEW) -> list[int]:
    return gen.generate(
        prompt,
        max_new_tokens=new,
        params=SamplingParams(greedy=True),
        generator=torch.Generator(),
        stop_at_eod=False,
    ).tokens


def test_fifty_concurrent_clients(gen: TextGenerator) -> None:
    ref = {
        p: _alone(gen, p) for p in PROMPTS
    }  # before the server runs: the model is the scheduler's then
    server = make_server(gen, "127.0.0.1", 0, max_batch_size=8, max_queue=12, batch_wait_ms=5)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = "http://{}:{}".format(*server.server_address)
    outcomes: list[tuple[str, int, Any]] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        rnd = random.Random(c)
        for k in range(4):
            if (c + k) % 7 == 0:
                status, answer = _put(f"{base}/api", BAD[(c + k) % len(BAD)])
                kind, expected = "bad", None
            else:
                prompts = rnd.sample(PROMPTS, rnd.randint(1, 3))
                kind, expected = "ok", [ref[p] for p in prompts]
                for _ in range(
                    20
                ):  # a polite client: a 503 is asked again, a bounded number of times
                    status, answer = _put(f"{base}/api", _greedy(prompts))
                    if status != 503:
                        break
                    with lock:
                        outcomes.append(("busy", status, (answer, None)))
                    time.sleep(rnd.uniform(0.01, 0.05))
            with lock:
                outcomes.append((kind, status, (answer, expected)))

    try:
        clients = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(50)]
        for t in clients:
            t.start()
        for t in clients:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in clients), "a client hung"
        finals = [o for o in outcomes if o[0] != "busy"]
        assert len(finals) == 200
        for kind, status, (answer, expected) in outcomes:
            if kind == "bad":
                assert status == 400 and answer["error"], answer
            elif status == 503:
                assert "the queue is full" in answer["error"] and "retry" in answer["error"]
            else:
                assert status == 200 and answer["tokens"] == expected, answer
        # How many get through depends on the machine's speed (the rest are correct 503s): at least some do.
        assert sum(1 for k, s, _ in finals if k == "ok" and s == 200) >= 1
        health = _get(f"{base}/health")
        assert health["status"] == "ok" and health["queue"] == 0 and health["in_flight"] == 0
        assert _put(f"{base}/api", _greedy(PROMPTS[:3]))[1]["tokens"] == [
            ref[p] for p in PROMPTS[:3]
        ]
    finally:
        server.shutdown()
        server.server_close()
    assert not thread.is_alive()


def test_full_queue_is_503_and_queued_requests_are_answered(gen: TextGenerator) -> None:
    server = make_server(gen, "127.0.0.1", 0, max_queue=2)
    # The HTTP front alone: prompts are admitted and wait, none is generated yet.
    http = threading.Thread(target=server.httpd.serve_forever, daemon=True)
    http.start()
    base = "http://{}:{}".format(*server.server_address)
    waiting: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
    first = threading.Thread(
        target=lambda: waiting.put(_put(f"{base}/api", _greedy(PROMPTS[:2]))), daemon=True
    )
    first.start()
    try:
        deadline = time.monotonic() + 30
        while _get(f"{base}/health")["queue"] < 2:
            assert time.monotonic() < deadline, "the first request was never queued"
            time.sleep(0.02)
        req = urllib.request.Request(f"{base}/api", data=_greedy(["5"]), method="PUT")
        with pytest.raises(urllib.error.HTTPError) as busy:
            urllib.request.urlopen(req, timeout=30)
        assert busy.value.code == 503 and busy.value.headers["Retry-After"] == "1"
        assert "the queue is full (2 of 2 prompts waiting" in json.loads(busy.value.read())["error"]
        status, answer = _put(f"{base}/api", _greedy(PROMPTS[:3]))
        assert status == 400 and "at most 2 per request" in answer["error"]
        # The scheduler starts: the queued request is answered, and a stopped server 503s what is queued.
        sched = threading.Thread(target=server.scheduler.run, daemon=True)
        sched.start()
        status, answer = waiting.get(timeout=60)
        assert status == 200 and answer["tokens"] == [_alone(gen, p) for p in PROMPTS[:2]]
        server.scheduler.stop()
        sched.join(timeout=30)
        assert not sched.is_alive()
        status, answer = _put(f"{base}/api", _greedy(["5"]))
        assert status == 503 and "shutting down" in answer["error"]
        assert _get(f"{base}/health")["status"] == "shutting down"
    finally:
        server.scheduler.stop()
        server.scheduler.close()
        server.httpd.shutdown()
        server.server_close()


def _train_tp2(ck: str) -> None:
    from megatron.config import parse_args
    from megatron.training import pretrain

    flags = [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "32", "--micro-batch-size", "1",
        "--global-batch-size", "1", "--train-iters", "1", "--mock-data", "--vocab-size", "99",
        "--tensor-model-parallel-size", "2", "--eval-iters", "0", "--log-level", "WARNING",
        "--save", ck,
    ]  # fmt: skip
    pretrain(parse_args(flags))


@pytest.fixture(scope="module")
def ck(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("server") / "ckpt")
    run_distributed(_train_tp2, 2, path, init_process_group=False, timeout=300)
    return path


class _Server:
    """``tools/run_text_generation_server.py`` in a process group of its own (torchrun for nproc > 1)."""

    def __init__(self, ck: str, nproc: int, *flags: str) -> None:
        script = str(ROOT / "tools" / "run_text_generation_server.py")
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd = (
            [*launch, "--nproc-per-node", str(nproc), script]
            if nproc > 1
            else [sys.executable, script]
        )
        cmd += [
            "--load",
            ck,
            "--port",
            "0",
            "--device",
            "cpu",
            "--heartbeat-seconds",
            "0.2",
            *flags,
        ]
        env = {
            **os.environ,
            "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._ready: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if "serving PUT http://" in line:
                self._ready.put(line)

    def wait_ready(self, timeout: float = 90) -> tuple[str, int]:
        """The base URL and rank 0's pid, from its "serving" line."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._ready.get(timeout=0.2)
                break
            except queue.Empty:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    time.sleep(0.5)  # the last lines
                    raise AssertionError("the server did not start:\n" + self.output()) from None
        m = re.search(r"(http://[\d.]+:\d+)/api .*\(pid (\d+);", line)
        assert m, line
        return m.group(1), int(m.group(2))

    def output(self) -> str:
        return "".join(self.lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def ck_ref(ck: str) -> TextGenerator:
    return TextGenerator.from_checkpoint(ck, device="cpu")  # one process, the whole model


@pytest.mark.parametrize(
    "nproc,flags",
    [
        (1, []),
        (2, ["--tensor-model-parallel-size", "2", "--max-batch-size", "2"]),
        (2, ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"]),
    ],
    ids=["python", "torchrun-tp2", "torchrun-pp2"],
)
def test_server_process_answers_then_sigterm_stops_every_rank(
    ck: str, ck_ref: TextGenerator, nproc: int, flags: list[str]
) -> None:
    server = _Server(ck, nproc, *flags)
    try:
        base, pid = server.wait_ready()
        expected = _check_concurrent_greedy(base, ck_ref)
        _check_sampling_and_beam_search(base, ck_ref)
        # A bad request is a 400; idle for several heartbeats; still serving.
        status, answer = _put(f"{base}/api", b'{"prompts": ["x y"], "tokens_to_generate": 2}')
        assert status == 400 and "not token ids" in answer["error"], answer
        if nproc > 1 and "--max-batch-size" in flags:
            _check_second_server_cannot_bind(ck, nproc, flags, base)
        else:
            time.sleep(1.0)
        health = _get(f"{base}/health")
        assert health["status"] == "ok" and health["world_size"] == nproc, health
        status, answer = _put(f"{base}/api", _greedy(["40 41"], 6))
        assert status == 200 and answer["tokens"] == [expected[1].tokens]
        _check_sigterm_answers_queued_request(base, pid, server)
    finally:
        server.kill()
    out = server.output()
    assert "Traceback" not in out, out
    assert "stopped" in out, out


def _check_concurrent_greedy(base: str, ck_ref: TextGenerator) -> list[Any]:
    """Concurrent greedy requests, each answered as its prompts generated alone in one process; the expected
    generations of the prompts are returned."""
    prompts = ["1 2 3", "40 41", "7", "12 5 9 9"]
    results: dict[int, tuple[int, dict[str, Any]]] = {}
    threads = [
        threading.Thread(
            target=lambda i=i: results.__setitem__(
                i, _put(f"{base}/api", _greedy(prompts[i:], 6, logprobs=True))
            ),
            daemon=True,
        )
        for i in range(len(prompts))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    expected = ck_ref.generate_requests(
        [PromptRequest(p, 6, SamplingParams(greedy=True), 0, False, True) for p in prompts]
    )
    for i, (status, answer) in sorted(results.items()):
        assert status == 200, answer
        assert answer["tokens"] == [e.tokens for e in expected[i:]]
        want = [e.prompt_log_probs + e.log_probs for e in expected[i:]]
        for got, ref in zip(answer["logprobs"], want, strict=True):
            assert got == pytest.approx(ref, abs=1e-4)  # TP sums in another order
    return expected


def _check_sampling_and_beam_search(base: str, ck_ref: TextGenerator) -> None:
    # Seeded sampling: prompt i samples with prompt_seed(S, i), as the one-process generator does.
    body = {"prompts": ["3 4", "3 4"], "tokens_to_generate": 6, "top_k": 5, "random_seed": 9}
    status, answer = _put(f"{base}/api", json.dumps(body).encode())
    sampled = ck_ref.generate_requests(
        [PromptRequest("3 4", 6, SamplingParams(top_k=5), prompt_seed(9, i)) for i in (0, 1)]
    )
    assert status == 200 and answer["tokens"] == [s.tokens for s in sampled], answer
    # Beam search is a work item of its own.
    body = {"prompts": ["5 6"], "tokens_to_generate": 4, "beam_width": 2}
    status, answer = _put(f"{base}/api", json.dumps(body).encode())
    beams = ck_ref.beam_search("5 6", beam_width=2, max_new_tokens=4, num_return_gen=2)
    assert status == 200 and answer["tokens"] == [b.tokens for b in beams], answer


def _check_second_server_cannot_bind(ck: str, nproc: int, flags: list[str], base: str) -> None:
    """A second TP = 2 server on the same port: rank 0 cannot bind, and every rank exits (none waits)."""
    port = base.rsplit(":", 1)[1]
    second = _Server(ck, nproc, *flags, "--port", port)
    try:
        rc = second.proc.wait(timeout=90)
    finally:
        second.kill()
    assert rc != 0 and f"cannot listen on 127.0.0.1:{port}" in second.output(), second.output()


def _check_sigterm_answers_queued_request(base: str, pid: int, server: _Server) -> None:
    """SIGTERM while a request is queued: it is answered (200, or 503 for prompts not started)."""
    late: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
    big = _greedy(["1"] * 8, 20)
    threading.Thread(target=lambda: late.put(_put(f"{base}/api", big)), daemon=True).start()
    deadline = time.monotonic() + 10
    while late.empty() and time.monotonic() < deadline:
        h = _get(f"{base}/health")
        if h["queue"] or h["in_flight"]:
            break
        time.sleep(0.02)
    os.kill(pid, signal.SIGTERM)
    status, answer = late.get(timeout=60)
    assert status in (200, 503), answer
    assert server.proc.wait(timeout=60) == 0, server.output()


def test_port_in_use_is_one_line(ck: str, capsys: pytest.CaptureFixture[str]) -> None:
    import logging
    import socket

    from tools import run_text_generation_server

    root = logging.getLogger()
    before = list(root.handlers)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        try:
            rc = run_text_generation_server.main(
                ["--load", ck, "--port", str(port), "--device", "cpu"]
            )
        finally:
            for h in root.handlers[:]:  # main() configured logging on pytest's captured stderr
                if h not in before:
                    root.removeHandler(h)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [
        f"error: cannot listen on 127.0.0.1:{port} (Address already in use); use another --port."
    ], err
