"""``MockGPTDataset`` for ``--mock-data``: deterministic synthetic samples, no files.

Sample ``i`` is an arithmetic progression modulo the vocabulary, ``text[k] = (start + k * step) % vocab_size`` with
``start`` and ``step`` drawn from ``np.random.RandomState([seed, i])``: independent of the order samples are read
in (any DP layout, any number of loader workers), identical across runs, and learnable (a model that has seen two
tokens can predict the rest), so smoke tests can watch the loss fall.
"""

from __future__ import annotations

import numpy as np
import torch


class MockGPTDataset(torch.utils.data.Dataset):
    """``num_samples`` items ``{"text": int64[seq_length + 1]}`` with ids in ``[0, vocab_size)``.

    Args:
        num_samples: dataset length.
        seq_length: tokens per training sequence (items hold one more).
        vocab_size: exclusive upper bound of the ids.
        seed: data seed (``--seed``).
        name: split name, shown in errors and descriptions.

    Raises:
        ValueError: a non-positive size, length or vocabulary.
    """

    def __init__(
        self, num_samples: int, seq_length: int, vocab_size: int, seed: int, name: str = "mock"
    ) -> None:
        for flag, value in (("num_samples", num_samples), ("--seq-length", seq_length)):
            if value < 1:
                raise ValueError(f"MockGPTDataset: {flag} must be >= 1, got {value}.")
        if vocab_size < 2:
            raise ValueError(
                f"MockGPTDataset: vocab_size must be >= 2, got {vocab_size}; set --vocab-size or a tokenizer."
            )
        self.num_samples = int(num_samples)
        self.seq_length = int(seq_length)
        self.vocab_size = int(vocab_size)
        self.seed = int(seed)
        self.name = name
        self.desc = (
            f"Mock GPT dataset\n\nDataset name {name}\nNumber of samples {num_samples}\n"
            f"Sequence length {seq_length}\nVocab size {vocab_size}\nRandom seed {seed}\n"
        )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        idx = int(idx)
        if not 0 <= idx < self.num_samples:
            raise IndexError(
                f"sample {idx} out of range for {self.name} mock dataset of {self.num_samples}"
            )
        rng = np.random.RandomState([self.seed & 0xFFFFFFFF, idx])
        start = int(rng.randint(0, self.vocab_size))
        step = int(rng.randint(1, min(self.vocab_size, 17)))
        k = np.arange(self.seq_length + 1, dtype=np.int64)
        return {"text": (start + k * step) % self.vocab_size}
