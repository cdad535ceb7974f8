"""The REST server (PUT /api, Megatron's request shape) and its CLI client, over a real local HTTP socket."""

from __future__ import annotations

import io
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import torch

from megatron.config import ModelConfig
from megatron.model import GPTModel
from megatron.mpu.context import ParallelContext
from megatron.text_generation import SamplingParams, TextGenerator
from megatron.text_generation.server import make_server
from megatron.tokenizer import build_tokenizer
from tools import run_text_generation_server, text_generation_cli

CFG = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=32,
    max_position_embeddings=32,
    vocab_size=60,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, TextGenerator]]:
    tok = build_tokenizer(tokenizer_type="NullTokenizer", vocab_size=59)  # ids 0..58, EOD 59
    gen = TextGenerator(
        GPTModel(CFG, ParallelContext(seed=4)).eval(), CFG, tok, torch.device("cpu")
    )
    server = make_server(gen, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    yield f"http://{host}:{port}", gen
    server.shutdown()
    server.server_close()


def _raw(url: str, method: str, data: bytes | None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_generation_requests(served) -> None:
    base, gen = served
    body = {"prompts": ["1 2 3", "40"], "tokens_to_generate": 6, "top_k": 1, "stop_at_eod": False}
    answer = text_generation_cli.request(f"{base}/api", body)
    for prompt, text, tokens in zip(body["prompts"], answer["text"], answer["tokens"], strict=True):
        ref = gen.generate(
            prompt,
            max_new_tokens=6,
            params=SamplingParams(greedy=True),
            generator=torch.Generator(),
            stop_at_eod=False,
        )
        assert tokens == ref.tokens and text == prompt + ref.text
    sampled = {"prompts": ["5"], "tokens_to_generate": 8, "top_p": 0.9, "random_seed": 3}
    first = text_generation_cli.request(f"{base}/api", sampled)
    assert text_generation_cli.request(f"{base}/api", sampled) == first  # same seed, same text


@pytest.mark.parametrize(
    "body,message",
    [
        (b"{not json", "not JSON"),
        (b'{"prompts": []}', "non-empty list of strings"),
        (b'{"prompts": ["1"], "tokens_to_generate": 0}', "'tokens_to_generate' must be >= 1"),
        (b'{"prompts": ["1"], "top_k": 2, "top_p": 0.5}', "are exclusive"),
        (b'{"prompts": ["1"], "temperature": "hot"}', "'temperature' must be a float"),
        (b'{"prompts": ["1"], "beam_width": 2}', "unknown field(s) ['beam_width']"),
        (b'{"prompts": ["1"], "random_seed": -1}', "'random_seed' must be a non-negative"),
        (  # Megatron's "Too many tokens": refused, not cut short (context 32 here)
            b'{"prompts": ["1 2 3"], "tokens_to_generate": 40}',
            "more than the model's context of 32 positions; request at most 29 new tokens",
        ),
    ],
)
def test_bad_requests_get_400(served, body: bytes, message: str) -> None:
    base, _ = served
    status, answer = _raw(f"{base}/api", "PUT", body)
    assert status == 400 and message in answer["error"], answer


def test_length_checks_before_generating(served) -> None:
    import http.client

    base, _ = served
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("PUT", "/api")
    conn.putheader("Content-Length", "-5")
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 400 and "send 0.." in json.loads(resp.read())["error"]
    conn.close()
    too_long = " ".join(["1"] * 40)  # the context is 32 tokens
    status, answer = _raw(
        f"{base}/api",
        "PUT",
        json.dumps({"prompts": ["1", too_long], "tokens_to_generate": 2}).encode(),
    )
    assert status == 400 and "context" in answer["error"], answer


def test_wrong_method_path_and_cli(served, monkeypatch, capsys) -> None:
    base, _ = served
    assert _raw(f"{base}/api", "GET", None)[0] == 405
    assert _raw(f"{base}/generate", "PUT", b"{}")[0] == 404
    monkeypatch.setattr("sys.stdin", io.StringIO("1 2\n7\n"))
    assert (
        text_generation_cli.main([base.removeprefix("http://"), "--tokens-to-generate", "3"]) == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("1 2") and lines[1].startswith("7")
    monkeypatch.setattr("sys.stdin", io.StringIO("1\n"))
    assert (
        text_generation_cli.main([base.removeprefix("http://"), "--top_k", "2", "--top_p", "0.3"])
        == 2
    )
    assert "HTTP 400" in capsys.readouterr().err
    assert run_text_generation_server.main(["--load", "/nonexistent/ckpt"]) == 2
    assert "holds no Trident checkpoint" in capsys.readouterr().err
