"""SentencePiece tokenizers (``--tokenizer-model model.model``): Megatron's two flavours.

* :class:`GPTSentencePieceTokenizer`: plain SentencePiece encode/decode, no BOS added; ``eod`` is the model's EOS
  (LLaMA-style ``tokenizer.model``). ``vocab_size`` is the model's piece count.
* :class:`SentencePieceTokenizer`: Megatron's T5/BERT-era flavour. After the model's pieces it appends, when the
  model lacks them, ``<CLS> <SEP> <EOD> <MASK>`` then ``<PAD> <BOS> <EOS>`` (the model's own pad/bos/eos pieces are
  reused when it has them) and ``<extra_id_0..N-1>``; ``eod`` is ``<EOD>``. Those special strings are recognised
  inside text by ``tokenize`` (split out and mapped to their ids), and ``detokenize`` writes them back.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron.tokenizer.tokenizer import MegatronTokenizer


def _load(model_file: str) -> object:
    import sentencepiece

    try:
        return sentencepiece.SentencePieceProcessor(model_file=model_file)
    except Exception as e:
        raise ValueError(f"--tokenizer-model {model_file} is not a SentencePiece model: {e}") from e


class GPTSentencePieceTokenizer(MegatronTokenizer):
    """Plain SentencePiece (no added tokens); ``eod = eos_id``, ``bos = bos_id``, ``pad = pad_id`` (None if absent).

    Raises:
        ValueError: the file is not a SentencePiece model, or the model has no EOS piece.
    """

    name = "GPTSentencePieceTokenizer"

    def __init__(self, model_file: str) -> None:
        self._sp = _load(model_file)
        if self._sp.eos_id() < 0:
            raise ValueError(
                f"--tokenizer-model {model_file} has no EOS piece, which GPTSentencePieceTokenizer uses as EOD."
            )

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts), num_threads=1)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def vocab(self) -> dict[str, int]:
        return {self._sp.id_to_piece(i): i for i in range(self.vocab_size)}

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> int | None:
        return self._sp.bos_id() if self._sp.bos_id() >= 0 else None

    @property
    def pad(self) -> int | None:
        return self._sp.pad_id() if self._sp.pad_id() >= 0 else None


class SentencePieceTokenizer(MegatronTokenizer):
    """Megatron's SentencePieceTokenizer: the model's pieces plus appended special tokens (module docstring).

    Args:
        model_file: the ``.model`` file.
        vocab_extra_ids: number of ``<extra_id_i>`` sentinels to append (``--vocab-extra-ids``).
    """

    name = "SentencePieceTokenizer"

    def __init__(self, model_file: str, vocab_extra_ids: int = 0) -> None:
        self._sp = _load(model_file)
        self._vocab = {self._sp.id_to_piece(i): i for i in range(self._sp.get_piece_size())}
        self._special: dict[str, int] = {}

        def add(token: str) -> int:
            if token not in self._vocab:
                self._vocab[token] = len(self._vocab)
            self._special[token] = self._vocab[token]
            return self._vocab[token]

        for token in ("<CLS>", "<SEP>"):
            add(token)
        self._eod = add("<EOD>")
        add("<MASK>")
        ids = {}
        for kind, own_id, fallback in (
            ("pad", self._sp.pad_id(), "<PAD>"),
            ("bos", self._sp.bos_id(), "<BOS>"),
            ("eos", self._sp.eos_id(), "<EOS>"),
        ):
            ids[kind] = add(self._sp.id_to_piece(own_id) if own_id >= 0 else fallback)
        self._pad, self._bos, self._eos = ids["pad"], ids["bos"], ids["eos"]
        for i in range(vocab_extra_ids):
            add(f"<extra_id_{i}>")
        self._inv_special = {i: t for t, i in self._special.items()}

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        start = 0
        while True:
            hits = [(text.find(tok, start), tok) for tok in self._special]
            hits = [(pos, tok) for pos, tok in hits if pos >= 0]
            if not hits:
                break
            pos, tok = min(hits, key=lambda h: (h[0], -len(h[1])))
            ids.extend(self._sp.encode(text[start:pos]))
            ids.append(self._special[tok])
            start = pos + len(tok)
        ids.extend(self._sp.encode(text[start:]))
        return ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        texts = list(texts)
        plain = [not any(tok in t for tok in self._special) for t in texts]
        if all(plain):
            return self._sp.encode(texts, num_threads=1)
        out = self._sp.encode([t if p else "" for t, p in zip(texts, plain)], num_threads=1)
        return [ids if p else self.tokenize(t) for ids, t, p in zip(out, texts, plain)]

    def detokenize(self, ids: Sequence[int]) -> str:
        text, last = "", 0
        ids = [int(i) for i in ids]
        for i, token_id in enumerate(ids):
            if token_id in self._inv_special:
                text += self._sp.decode(ids[last:i]) + " " + self._inv_special[token_id] + " "
                last = i + 1
        return text + self._sp.decode(ids[last:])

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eos

    @property
    def bos(self) -> int | None:
        return self._bos

    @property
    def pad(self) -> int | None:
        return self._pad
