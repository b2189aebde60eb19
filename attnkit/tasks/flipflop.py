"""Flip-flop language modelling (Liu et al., arXiv 2306.00946; PaTH Table 1).

Vocabulary ``w r i 0 1`` (ids 0-4). A sequence of ``T`` tokens is ``T/2`` (instruction, bit) pairs; the first
instruction is ``w``, the last ``r``, the others ``w`` / ``r`` / ``i`` with probabilities
``((1 - p_i)/2, (1 - p_i)/2, p_i)``. The bit after ``w`` or ``i`` is uniform; the bit after ``r`` repeats the bit
of the most recent ``w``. Training is next-token prediction on every position (``train_on="all"``, the paper's
setting) or on the read answers only (``train_on="reads"``). The metric scores only the bit after each ``r``, by
argmax over the two bit tokens: per-read error and per-sequence error (a sequence with any wrong read).

Test sets: ``in_distribution`` (p_i = 0.8), ``sparse`` (p_i = 0.98, long gaps between a write and its read;
errors are rare, so it is the largest set) and ``dense`` (p_i = 0.1). The defaults (256 / 1024 / 256
sequences) keep CPU evaluation quick; the paper uses far larger sets, pass ``test_sizes`` to match it.
"""

from __future__ import annotations

import torch

from .base import IGNORE_INDEX, Batch, Task, check_batch

W, R, I, ZERO, ONE = 0, 1, 2, 3, 4

DEFAULT_TEST_SETS = {"in_distribution": (0.8, 256), "sparse": (0.98, 1024), "dense": (0.1, 256)}


def flipflop_sequences(batch_size: int, seq_len: int, p_ignore: float, generator: torch.Generator) -> torch.Tensor:
    """``[batch_size, seq_len]`` int64 flip-flop strings (ids: w=0 r=1 i=2 0=3 1=4)."""
    P = seq_len // 2
    u = torch.rand(batch_size, P, generator=generator)
    # u < p_i: ignore; the rest splits evenly between write and read.
    instr = torch.where(u < p_ignore, I, torch.where(u < p_ignore + (1 - p_ignore) / 2, W, R))
    instr[:, 0] = W
    instr[:, -1] = R
    bits = torch.randint(0, 2, (batch_size, P), generator=generator)
    pos = torch.arange(P).expand(batch_size, P)
    last_write = torch.where(instr == W, pos, -1).cummax(dim=1).values
    bits = torch.where(instr == R, bits.gather(1, last_write), bits)
    seq = torch.stack([instr, bits + ZERO], dim=-1).reshape(batch_size, 2 * P)
    return seq.long()


class FlipFlop(Task):
    """Flip-flop LM. Options: ``seq_len`` (even, default 512), ``p_ignore`` (training p_i, default 0.8),
    ``train_on`` ("all" or "reads"), ``test_sizes`` (``{set name: number of sequences}`` over the three sets),
    ``validation_size`` (sequences at the training p_i, default 256; scored on the reads like the test sets)."""

    name = "flipflop"
    vocab_size = 5

    def __init__(
        self,
        seed: int = 0,
        seq_len: int = 512,
        p_ignore: float = 0.8,
        train_on: str = "all",
        test_sizes: dict[str, int] | None = None,
        validation_size: int = 256,
    ) -> None:
        super().__init__(seed, validation_size)
        if seq_len < 4 or seq_len % 2:
            raise ValueError(f"seq_len must be even and >= 4, got {seq_len}")
        if not 0.0 <= p_ignore < 1.0:
            raise ValueError(f"p_ignore must lie in [0, 1), got {p_ignore}")
        if train_on not in ("all", "reads"):
            raise ValueError(f"train_on must be 'all' or 'reads', got {train_on!r}")
        unknown = set(test_sizes or {}) - set(DEFAULT_TEST_SETS)
        if unknown:
            raise ValueError(f"test_sizes: unknown sets {sorted(unknown)}; known: {sorted(DEFAULT_TEST_SETS)}")
        self.seq_len, self.p_ignore, self.train_on = seq_len, p_ignore, train_on
        self.test_sizes = {k: (test_sizes or {}).get(k, n) for k, (_, n) in DEFAULT_TEST_SETS.items()}

    def _labels(self, seq: torch.Tensor, train_on: str) -> torch.Tensor:
        labels = torch.full_like(seq, IGNORE_INDEX)
        labels[:, :-1] = seq[:, 1:]
        if train_on == "reads":
            labels[seq != R] = IGNORE_INDEX
        return labels

    def sample(self, batch_size: int, generator: torch.Generator) -> Batch:
        seq = flipflop_sequences(batch_size, self.seq_len, self.p_ignore, generator)
        return seq, self._labels(seq, self.train_on)

    def _build_test_sets(self) -> dict[str, Batch]:
        sets = {}
        for set_name, (p_ignore, _) in DEFAULT_TEST_SETS.items():
            seq = flipflop_sequences(self.test_sizes[set_name], self.seq_len, p_ignore, self.test_generator(set_name))
            # Test labels mark only what is scored: the bit after each read.
            sets[set_name] = (seq, self._labels(seq, "reads"))
        return sets

    def _build_validation_sets(self) -> dict[str, Batch]:
        generator = self.validation_generator("validation")
        seq = flipflop_sequences(self.validation_size, self.seq_len, self.p_ignore, generator)
        return {"validation": (seq, self._labels(seq, "reads"))}

    def statistics(self, outputs: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Reads are found from ``input_ids`` (an ``r`` at position t; its answer is ``input_ids[:, t + 1]``)."""
        check_batch(outputs, input_ids)
        reads = input_ids[:, :-1] == R
        target = input_ids[:, 1:]
        if outputs.is_floating_point():
            # Restricted argmax: only the two bit tokens compete, as in the paper.
            pred = torch.where(outputs[:, :-1, ONE] > outputs[:, :-1, ZERO], ONE, ZERO)
        else:
            pred = outputs[:, :-1]
        wrong = (pred != target) & reads
        return {
            "read_errors": float(wrong.sum()),
            "reads": float(reads.sum()),
            "sequence_errors": float(wrong.any(-1).sum()),
            "sequences": float(input_ids.shape[0]),
        }

    def finalize(self, stats: dict[str, float]) -> dict[str, float]:
        return {
            "read_error": stats["read_errors"] / max(stats["reads"], 1.0),
            "sequence_error": stats["sequence_errors"] / max(stats["sequences"], 1.0),
        }
