"""Llama 3 / Qwen2.5-style tokenizer.json files built offline: fast-encoder ids equal the ``tokenizers`` reference,
BOS/EOS as the files say (checked against transformers), int32 datasets, bad files refused in one line."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from megatron.data.demo_corpus import pydoc_topics
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.testing.tokenizers import FAMILY_SIZES, family_tokenizer
from megatron.text_generation.generation import TextGenerator
from megatron.tokenizer import HFTokenizer, TokenizerFileError
from megatron.tokenizer.fast_bpe import PROBE_TEXTS, fast_bpe_from_spec, probe_mismatch
from tools import preprocess_data

DOCS = list(pydoc_topics())
EXTRA = [
    "Year 2024: 1234567890 items, 3.14159, ٣٤٥ and 10,000,000.",
    "I'M SURE it'S FINE; DON'T they'LL\r\n\r\n   \t\n",
    "Cafe\u0301 A\u030a \ufb01 \u212b \u1100\u1161 Ω 東京 🙂",
]


@pytest.fixture(scope="session")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both tokenizers, built once per session (about 0.6 s each)."""
    root = tmp_path_factory.mktemp("families")
    return {k: family_tokenizer(k, root / k) for k in ("llama3", "qwen2")}  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_fast_encoder_gives_the_reference_ids(families: dict[str, Path], kind: str) -> None:
    tok = HFTokenizer(str(families[kind]))
    assert tok.encoder.startswith("tiktoken"), tok.encoder
    assert tok.vocab_size == FAMILY_SIZES[kind][1]
    texts = [*PROBE_TEXTS, *EXTRA, *DOCS]
    fast = tok.tokenize_batch(texts)
    assert fast == tok._reference_batch(texts)
    assert max(max(ids) for ids in fast if ids) > 65_535  # ids past uint16 in ordinary text
    pieces = [p for p, _ in tok._tok.pre_tokenizer.pre_tokenize_str("1234567")]
    assert pieces == (["123", "456", "7"] if kind == "llama3" else list("1234567"))
    assert tok.detokenize(tok.tokenize(EXTRA[2])) == (
        EXTRA[2] if kind == "llama3" else __import__("unicodedata").normalize("NFC", EXTRA[2])
    )


def test_the_probes_catch_a_wrong_regex_or_a_missing_nfc(families: dict[str, Path]) -> None:
    """Without the family's split (GPT-2's instead) or without NFC, the fast encoder differs on a probe text, so
    it is never used with silently different ids."""
    for kind, edit in (("llama3", "regex"), ("qwen2", "nfc")):
        spec = json.loads((families[kind] / "tokenizer.json").read_text(encoding="utf-8"))
        tok = HFTokenizer(str(families[kind]))
        if edit == "regex":
            spec["pre_tokenizer"] = {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "use_regex": True,
            }
        fast, why = fast_bpe_from_spec(spec)
        assert fast is not None, why
        if edit == "nfc":
            fast._nfc = False
        assert probe_mismatch(fast, tok._reference_batch) is not None


def test_bos_eos_as_the_files_say_and_as_transformers_encodes(families: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    llama, qwen = HFTokenizer(str(families["llama3"])), HFTokenizer(str(families["qwen2"]))
    assert (llama.bos, llama.eod, llama.prefix_ids, llama.suffix_ids) == (
        128_000,
        128_001,
        (128_000,),
        (),
    )
    assert (qwen.bos, qwen.eod, qwen.pad, qwen.prefix_ids) == (None, 151_643, 151_643, ())
    for tok, path in ((llama, families["llama3"]), (qwen, families["qwen2"])):
        theirs = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        text = "Hello world, 12345."
        assert theirs(text).input_ids == [*tok.prefix_ids, *tok.tokenize(text), *tok.suffix_ids]
    # generation prompts: <|begin_of_text|> exactly once, also when typed; Qwen's prompt as is
    gen = SimpleNamespace(tokenizer=llama, tokenizer_fallback=False)
    assert TextGenerator.prompt_ids(gen, "Hi") == [128_000, *llama.tokenize("Hi")]  # type: ignore[arg-type]
    assert llama.tokenize_prompt("<|begin_of_text|>Hi") == [128_000, *llama.tokenize("Hi")]
    assert llama.tokenize_prompt("") == [128_000]
    assert qwen.tokenize_prompt("Hi") == qwen.tokenize("Hi") and qwen.tokenize_prompt("") == [
        151_643
    ]


def test_preprocess_int32_with_bos_and_eod_reads_back_exactly(
    families: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenizers import Tokenizer

    docs = [*DOCS[:40], *EXTRA, "<|eot_id|> special inside"]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    out = tmp_path / "llama"
    argv = ["--input", str(src), "--tokenizer-type", "HFTokenizer", "--tokenizer-model"]
    argv += [str(families["llama3"]), "--append-eod", "--output-prefix", str(out), "--workers", "2"]
    rc = preprocess_data.main([*argv, "--log-interval", "100000000"])
    assert rc == 0, capsys.readouterr().err
    ds = MMapIndexedDataset(f"{out}_text_document")
    assert ds.dtype == np.int32
    reference = Tokenizer.from_file(str(families["llama3"] / "tokenizer.json"))
    for i, text in enumerate(
        docs
    ):  # the reference's own encode adds <|begin_of_text|>; then the EOD
        want = [*reference.encode(text).ids, 128_001]
        assert want[0] == 128_000 and ds[i].tolist() == want
    assert max(int(ds[i].max()) for i in range(len(docs))) > 65_535


def _bad_files(root: Path, good: Path) -> list[tuple[list[str], str]]:
    not_json = root / "not-json"
    not_json.mkdir()
    (not_json / "tokenizer.json").write_text('{"model": {"type": "BPE",\n  oops}', encoding="utf-8")
    unknown = root / "unknown"
    unknown.mkdir()
    spec = json.loads((good / "tokenizer.json").read_text(encoding="utf-8"))
    spec["model"]["type"] = "SentencePieceBPE"
    (unknown / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    bad_config = root / "bad-config"
    bad_config.mkdir()
    (bad_config / "tokenizer.json").write_text(
        json.dumps(spec | {"model": {**spec["model"], "type": "BPE"}})
    )
    (bad_config / "tokenizer_config.json").write_text("[1, 2]", encoding="utf-8")
    return [
        ([str(root / "missing")], "does not exist"),
        ([str(not_json)], "tokenizer.json:2: tokenizer.json is not valid JSON"),
        (
            [str(unknown)],
            "model type 'SentencePieceBPE'; a tokenizer.json needs a model of type BPE",
        ),
        ([str(bad_config)], "tokenizer_config.json:1: tokenizer_config.json must be a JSON object"),
    ]


def test_bad_tokenizer_files_one_line_exit_2(
    families: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "hello"}) + "\n", encoding="utf-8")
    for model, message in _bad_files(tmp_path, families["llama3"]):
        with pytest.raises(TokenizerFileError, match="tokenizer"):
            HFTokenizer(model[0])
        argv = ["--input", str(src), "--tokenizer-type", "HFTokenizer", "--tokenizer-model", *model]
        rc = preprocess_data.main([*argv, "--output-prefix", str(tmp_path / "o")])
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc == 2 and len(lines) == 1 and message in lines[0], (model, err)
        assert not list(tmp_path.glob("o_*"))
