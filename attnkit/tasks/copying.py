"""Copying (Jelassi et al., "Repeat After Me", arXiv 2402.01032): a probe of how much state a model keeps.

A sequence is ``$ s | s .`` with ``s`` a string of ``n`` uniform random letters. Tokens: 0 ``PAD``, 1 ``$``,
2 ``|``, 3 ``.``, 4-29 the letters ``a``-``z`` (vocabulary 30). Only the copied half is scored: the outputs at
``|`` and at the copied letters, whose targets are the ``n`` letters and the closing ``.`` (so the model must
also know where the copy ends). Metric: ``sequence_accuracy`` is exact match of the whole copy, ``accuracy`` the
per-token accuracy.

Training lengths are uniform in ``[min_len, max_len]`` (default 1-64); shorter sequences are padded on the right
with ``PAD`` (labels -100), so ``seq_len = 2 * max_len + 3``. Test sets ``len{n}`` hold strings of exactly ``n``
letters (unpadded, length ``2n + 3``), by default at n = 1/4, 1/2, 1, 2, 3 and 4 times ``max_len`` (16, 32, 64,
128, 192, 256 for the default 64: up to 4x the longest training string).
"""

from __future__ import annotations

import torch

from .base import IGNORE_INDEX, AccuracyTask, Batch

PAD, BOS, SEP, EOS, FIRST_LETTER, NUM_LETTERS = 0, 1, 2, 3, 4, 26
TEST_FRACTIONS = (0.25, 0.5, 1, 2, 3, 4)  # default test string lengths, in max_len


def copy_sequences(lengths: torch.Tensor, generator: torch.Generator) -> Batch:
    """Copy batch for string lengths ``lengths [B]`` int64: ``input_ids, labels`` ``[B, 2 * max(lengths) + 3]``."""
    B, n_max = lengths.shape[0], int(lengths.max())
    T = 2 * n_max + 3
    letters = torch.randint(FIRST_LETTER, FIRST_LETTER + NUM_LETTERS, (B, n_max), generator=generator)
    pos = torch.arange(T).expand(B, T)
    n = lengths.unsqueeze(1)
    # Position p holds: 0 -> $, 1..n -> s[p-1], n+1 -> |, n+2..2n+1 -> s[p-n-2], 2n+2 -> '.', later -> PAD.
    src = torch.where(pos <= n, pos - 1, pos - n - 2).clamp(0, n_max - 1)
    seq = letters.gather(1, src)
    seq = torch.where(pos == 0, BOS, seq)
    seq = torch.where(pos == n + 1, SEP, seq)
    seq = torch.where(pos == 2 * n + 2, EOS, seq)
    seq = torch.where(pos > 2 * n + 2, PAD, seq)
    labels = torch.full_like(seq, IGNORE_INDEX)
    labels[:, :-1] = seq[:, 1:]
    scored = (pos >= n + 1) & (pos <= 2 * n + 1)
    labels = torch.where(scored, labels, IGNORE_INDEX)
    return seq, labels


class Copying(AccuracyTask):
    """Copying. Options: ``min_len`` (1), ``max_len`` (64), ``test_lengths`` (default ``TEST_FRACTIONS`` of max_len),
    ``test_size`` (sequences per test length, default 128), ``validation_size`` (sequences of the validation set,
    training lengths, default 256). Strings of a few letters are few (26 of one letter), so the same short string
    can occur in training, validation and test: their streams are distinct, their examples need not be."""

    name = "copying"
    vocab_size = FIRST_LETTER + NUM_LETTERS

    def __init__(
        self,
        seed: int = 0,
        min_len: int = 1,
        max_len: int = 64,
        test_lengths: tuple[int, ...] | None = None,
        test_size: int = 128,
        validation_size: int = 256,
    ) -> None:
        super().__init__(seed, validation_size)
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
        if test_lengths is None:
            test_lengths = tuple(dict.fromkeys(max(1, round(f * max_len)) for f in TEST_FRACTIONS))
        if any(n < 1 for n in test_lengths):
            raise ValueError(f"test_lengths must be positive, got {test_lengths}")
        self.min_len, self.max_len = min_len, max_len
        self.test_lengths, self.test_size = tuple(test_lengths), test_size
        self.seq_len = 2 * max_len + 3

    def sample(self, batch_size: int, generator: torch.Generator) -> Batch:
        lengths = torch.randint(self.min_len, self.max_len + 1, (batch_size,), generator=generator)
        input_ids, labels = copy_sequences(lengths, generator)
        # Pad every batch to seq_len, so batches stack and compiled models see one shape.
        pad = self.seq_len - input_ids.shape[1]
        input_ids = torch.nn.functional.pad(input_ids, (0, pad), value=PAD)
        labels = torch.nn.functional.pad(labels, (0, pad), value=IGNORE_INDEX)
        return input_ids, labels

    def _build_test_sets(self) -> dict[str, Batch]:
        sets = {}
        for n in self.test_lengths:
            lengths = torch.full((self.test_size,), n, dtype=torch.int64)
            sets[f"len{n}"] = copy_sequences(lengths, self.test_generator(f"len{n}"))
        return sets
