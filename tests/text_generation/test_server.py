"""The REST server (PUT /api, Megatron's request shape) and its CLI client, over a real local HTTP socket."""

from __future__ import annotations

import io
import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import torch

from megatron.config import ModelConfig
from megatron.model import GPTModel
from megatron.mpu.context import ParallelContext
from megatron.text_generation import PromptRequest, SamplingParams, TextGenerator, prompt_seed
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


@pytest.fixture(autouse=True)
def _no_stale_log_handlers() -> Iterator[None]:
    """``main()`` of a tool run in-process calls ``setup_logging``, leaving a root handler on pytest's captured
    (then closed) stderr; the server's threads logging through it print "--- Logging error ---"."""
    root = logging.getLogger()
    stale = [h for h in root.handlers if getattr(h, "_trident", False)]
    for h in stale:
        root.removeHandler(h)
    yield
    for h in root.handlers[:]:
        if getattr(h, "_trident", False):
            root.removeHandler(h)
    for h in stale:
        root.addHandler(h)


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
        (b'{"prompts": ["1"], "beam_size": 2}', "unknown field(s) ['beam_size']"),
        (b'{"prompts": ["1"], "random_seed": -1}', "'random_seed' must be a non-negative"),
        # once a dead request thread and no answer (UnicodeDecodeError, RecursionError), or a 500 (OverflowError)
        (b'{"prompts": ["\xff 1"]}', "the body is not UTF-8 (byte 0xff at offset 14)"),
        ('{"prompts": ["1"]}'.encode("utf-16"), "the body is not UTF-8"),
        (b"[" * 100_000, "the body nests JSON arrays/objects 100000 deep"),
        (b'{"prompts": ' + b"[" * 32 + b'"1"' + b"]" * 32 + b"}", "33 deep; a request needs 2"),
        (
            b'{"prompts": ["1"], "beam_width": 2, "length_penalty": 1e308}',
            "'length_penalty' (1e+308) must be a finite number in [-10, 10]",
        ),
        (
            b'{"prompts": ["1"], "beam_width": 2, "length_penalty": -Infinity}',
            "'length_penalty' (-inf) must be a finite number",
        ),
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
    base, gen = served
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
    address = base.removeprefix("http://")
    monkeypatch.setattr("sys.stdin", io.StringIO("1 2\n"))
    assert text_generation_cli.main([address, "--tokens-to-generate", "3", "--logprobs"]) == 0
    text, logprobs = capsys.readouterr().out.splitlines()
    new = (
        len(gen.prompt_ids(text)) - 2
    )  # generated tokens shown (1 to 3: EOD may end it, not shown)
    assert text.startswith("1 2") and len(json.loads(logprobs.removeprefix("logprobs: "))) in (
        1 + new,
        1 + new + 1,
    )
    monkeypatch.setattr("sys.stdin", io.StringIO("1 2\n"))
    assert (
        text_generation_cli.main([address, "--tokens-to-generate", "3", "--beam-width", "2"]) == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[1].startswith("score: ") and lines[3].startswith("score: ")
    assert run_text_generation_server.main(["--load", "/nonexistent/ckpt"]) == 2
    assert "holds no Trident checkpoint" in capsys.readouterr().err


def _log_softmax_oracle(gen: TextGenerator, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i = 1..n-1 from one plain forward of the whole sequence (no cache, no batch)."""
    tokens = torch.tensor([ids])
    with torch.no_grad():
        logits = gen.model(tokens, torch.arange(len(ids)).unsqueeze(0))  # [1, n, v']
    logp = torch.log_softmax(logits[0, :, : CFG.vocab_size].double(), dim=-1)
    return [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]


def test_logprobs_seeds_and_beams(served) -> None:
    base, gen = served
    url = f"{base}/api"
    body = {"prompts": ["1 2 3", "40"], "tokens_to_generate": 5, "top_k": 1, "stop_at_eod": False}
    answer = text_generation_cli.request(url, {**body, "logprobs": True})
    for prompt, tokens, logprobs in zip(body["prompts"], answer["tokens"], answer["logprobs"]):
        ids = gen.prompt_ids(prompt)
        assert len(logprobs) == len(ids) - 1 + len(tokens)  # Megatron's shape: tokens 1..end
        assert logprobs == pytest.approx(_log_softmax_oracle(gen, ids + tokens), abs=1e-5)
    # Seeds: prompt i of random_seed S samples with prompt_seed(S, i), batched or not (requests of one prompt
    # at a time through the server, or the generator directly).
    sampled = {"prompts": ["5", "7 8", "5"], "tokens_to_generate": 8, "top_p": 0.9}
    together = text_generation_cli.request(url, {**sampled, "random_seed": 41})
    assert together["tokens"][0] != together["tokens"][2]  # the same prompt twice: two samples
    assert text_generation_cli.request(url, {**sampled, "random_seed": 41}) == together
    for i, prompt in enumerate(sampled["prompts"]):
        req = PromptRequest(prompt, 8, SamplingParams(top_p=0.9), seed=prompt_seed(41, i))
        assert gen.generate_requests([req])[0].tokens == together["tokens"][i]
    first = text_generation_cli.request(url, {**sampled, "prompts": ["5"], "random_seed": 41})
    assert first["tokens"][0] == together["tokens"][0]
    # Beam search: Megatron's shape, the generator's result.
    beams = text_generation_cli.request(
        url, {"prompts": ["1 2"], "tokens_to_generate": 4, "beam_width": 3}
    )
    ref = gen.beam_search("1 2", beam_width=3, max_new_tokens=4, num_return_gen=3)
    assert beams["tokens"] == [r.tokens for r in ref]
    assert beams["text"] == ["1 2" + r.text for r in ref]
    assert beams["scores"] == pytest.approx([r.score for r in ref])
    assert beams["scores"] == sorted(beams["scores"], reverse=True)
    # A width above the vocabulary (60): one new token has 60 hypotheses, each scored log p (once an
    # invented [0] scored 0.0, repeated to fill 64 answers).
    wide = text_generation_cli.request(
        url, {"prompts": ["1 2"], "tokens_to_generate": 1, "beam_width": 64}
    )
    assert sorted(t[0] for t in wide["tokens"]) == list(range(CFG.vocab_size))
    ids = gen.prompt_ids("1 2")
    truth = [_log_softmax_oracle(gen, [*ids, t[0]])[-1] for t in wide["tokens"]]
    assert wide["scores"] == pytest.approx(truth, abs=1e-5)
    status, health = _raw(f"{base}/health", "GET", None)
    assert status == 200 and health["status"] == "ok" and health["queue"] == 0, health


@pytest.mark.parametrize(
    "body,message",
    [
        ({"prompts": ["1", "2"], "beam_width": 2}, "'beam_width' needs exactly one prompt; got 2"),
        ({"prompts": ["1"], "beam_width": 0}, "'beam_width' must be >= 1"),
        ({"prompts": ["1"], "stop_token": 3}, "'stop_token' applies to beam search only"),
        ({"prompts": ["1"], "beam_width": 2, "logprobs": True}, "'logprobs' is not available"),
        (
            {"prompts": ["1"], "beam_width": 2, "stop_token": 60, "tokens_to_generate": 4},
            "not a token id of this model (0..59)",
        ),
        ({"prompts": ["1"], "logprobs": "yes"}, "'logprobs' must be a bool"),
        ({"prompts": ["1"], "random_seed": 2**63}, "below 2**63"),
    ],
)
def test_bad_beam_and_logprob_fields_get_400(served, body: dict, message: str) -> None:
    base, _ = served
    status, answer = _raw(f"{base}/api", "PUT", json.dumps(body).encode())
    assert status == 400 and message in answer["error"], answer
