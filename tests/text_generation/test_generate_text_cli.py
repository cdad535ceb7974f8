"""tools/generate_text.py on a real checkpoint trained with --vocab-size only (no tokenizer recorded): requests
that do not fit the context are refused (Megatron's "Too many tokens"), output-file and prompt errors are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron.testing import run_distributed
from megatron.text_generation import LogitsSource, SamplingParams, generate_tokens
from megatron.text_generation.generation import TooManyTokensError
from tools import generate_text


def _train_null(ck: str) -> None:
    from megatron.config import parse_args
    from megatron.training import pretrain

    flags = [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
        "--global-batch-size", "1", "--train-iters", "1", "--mock-data", "--vocab-size", "99",
        "--eval-iters", "0", "--log-level", "WARNING", "--save", ck,
    ]  # fmt: skip
    pretrain(parse_args(flags))


@pytest.fixture(scope="module")
def ck(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("gen") / "ckpt")
    run_distributed(_train_null, 1, path, init_process_group=False)
    return path


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    rc = generate_text.main([*argv, "--device", "cpu"])
    out, err = capsys.readouterr()
    return rc, out, err


def test_generate_tokens_refuses_what_does_not_fit() -> None:
    model = LogitsSource(8, 16, logits_fn=lambda t: torch.zeros(1, t.shape[1], 8))
    common = {"params": SamplingParams(greedy=True)}
    out = generate_tokens(
        model, [1, 2, 3], max_new_tokens=13, generator=torch.Generator(), **common
    )
    assert len(out) == 13  # exactly fills the context
    with pytest.raises(TooManyTokensError, match="request at most 13 new tokens") as exc:
        generate_tokens(model, [1, 2, 3], max_new_tokens=14, generator=torch.Generator(), **common)
    assert isinstance(exc.value, ValueError)  # the REST server answers 400
    assert (exc.value.prompt_tokens, exc.value.max_new_tokens, exc.value.context) == (3, 14, 16)


def test_out_seq_length_too_long(ck: str, tmp_path: Path, capsys) -> None:
    out_file = tmp_path / "s.jsonl"
    argv = ["--load", ck, "--prompt", "1 2 3", "--greedy", "--sample-output-file", str(out_file)]
    rc, _, err = _run(capsys, [*argv, "--out-seq-length", "100"])
    assert rc == 2 and "Traceback" not in err and err.count("error:") == 1, err
    assert (
        "--out-seq-length (100) is too long: the prompt '1 2 3' has 3 token(s) and the model's context is 16, "
        "so at most 13 new tokens fit; use --out-seq-length 13 or less." in err
    )
    assert not out_file.exists()  # checked before anything is generated or written
    # A second prompt that does not fit is found before the first one is generated.
    rc, _, err = _run(capsys, [*argv, "--prompt", " ".join(["5"] * 10), "--out-seq-length", "8"])
    assert rc == 2 and "at most 6 new tokens fit" in err and not out_file.exists()
    # Unconditional sample (starts from EOD, 1 token).
    rc, _, err = _run(capsys, ["--load", ck, "--out-seq-length", "16"])
    assert rc == 2 and "an unconditional sample" in err and "--out-seq-length 15 or less" in err
    # The longest request that fits generates every token.
    rc, _, err = _run(capsys, [*argv, "--out-seq-length", "13", "--no-stop-at-eod"])
    assert rc == 0, err
    assert len(json.loads(out_file.read_text())["tokens"]) == 13


def test_sample_output_file_checked_before_loading(tmp_path: Path, capsys) -> None:
    # --load names no checkpoint: the output-file error comes first, so it is checked before the model loads.
    missing_ck = str(tmp_path / "no-ckpt")
    rc, _, err = _run(capsys, ["--load", missing_ck, "--sample-output-file", str(tmp_path)])
    assert rc == 2 and "Traceback" not in err and err.count("error:") == 1, err
    assert f"--sample-output-file {tmp_path} is a directory; give a file path" in err
    nested = tmp_path / "no" / "such" / "out.jsonl"
    rc, _, err = _run(capsys, ["--load", missing_ck, "--sample-output-file", str(nested)])
    assert rc == 2 and err.count("error:") == 1, err
    assert f"--sample-output-file {nested}: the directory {nested.parent} does not exist" in err


def test_length_penalty_and_prompt_file_checked_before_loading(tmp_path: Path, capsys) -> None:
    # Once: -inf a ZeroDivisionError, 1e308 an OverflowError, nan accepted (nan scores); an empty prompt file one
    # unconditional sample. Now one line each, before the (here missing) checkpoint is looked at.
    missing = ["--load", str(tmp_path / "no-ckpt"), "--prompt", "1", "--beam-width", "2"]
    for value, shown in (("-inf", "-inf"), ("1e308", "1e+308"), ("nan", "nan"), ("-10.5", "-10.5")):
        rc, _, err = _run(capsys, [*missing, f"--length-penalty={value}"])
        assert rc == 2 and "Traceback" not in err and err.count("error:") == 1, err
        assert f"--length-penalty ({shown}) must be a finite number in [-10, 10]" in err
    out_file = tmp_path / "samples.jsonl"
    out_file.write_text("an earlier run's samples\n")
    empty, latin1 = tmp_path / "empty.txt", tmp_path / "latin1.txt"
    empty.write_bytes(b"")
    latin1.write_bytes("na\xefve\n".encode("latin-1"))
    missing = ["--load", str(tmp_path / "no-ckpt"), "--sample-output-file", str(out_file)]
    rc, _, err = _run(capsys, [*missing, "--sample-input-file", str(empty)])
    assert rc == 2 and err.count("error:") == 1, err
    assert f"--sample-input-file {empty} is empty: it holds no prompts" in err
    rc, _, err = _run(capsys, [*missing, "--sample-input-file", str(latin1)])
    assert rc == 2 and err.count("error:") == 1, err
    assert f"--sample-input-file {latin1} is not UTF-8 text (byte 0xef at offset 2)" in err
    assert out_file.read_text() == "an earlier run's samples\n"


def test_text_prompt_on_checkpoint_without_tokenizer(ck: str, capsys) -> None:
    rc, _, err = _run(capsys, ["--load", ck, "--prompt", "the cat", "--out-seq-length", "2"])
    assert rc == 2 and "Traceback" not in err and err.count("error:") == 1, err
    assert "the prompt 'the cat' is not token ids ('the' is not an integer)" in err
    assert "this checkpoint records no tokenizer (it was trained with --vocab-size only)" in err
    assert "token ids separated by spaces" in err and "pass --tokenizer-type and its files" in err
    # Ids are fine; an out-of-range id keeps the tokenizer's own message.
    rc, out, err = _run(capsys, ["--load", ck, "--prompt", "1 2", "--out-seq-length", "2"])
    assert rc == 0 and out.startswith("1 2 "), err
    rc, _, err = _run(capsys, ["--load", ck, "--prompt", "1 500", "--out-seq-length", "2"])
    assert rc == 2 and "NullTokenizer id 500 is outside" in err
