"""Passkey retrieval / needle in a haystack, in the style of RULER's single-needle task (S-NIAH).

Vocabulary (``vocab_size = 15 + num_keys + 256``):

==========================  ==============================================================
id                          token
==========================  ==============================================================
0                           ``PAD`` (unused by the generator; free for padding)
1, 2, 3, 4                  ``KEY``, ``VAL``, ``QRY``, ``ANS``
5 … 14                      the digits 0 … 9
15 … 15 + num_keys - 1      key names
15 + num_keys + b           filler byte ``b`` (0 … 255)
==========================  ==============================================================

The haystack is a stream of filler bytes: the RULER noise sentence repeated (``haystack="noise"``, with a random
phase) or a random window of text (``haystack="text"``: ``text`` if given, else the default corpus of
``attnkit.tasks.language``). Needles ``KEY k VAL d1 d2 d3 d4 d5`` (8 tokens, distinct keys, uniform digits) are
inserted between filler tokens; the queries ``QRY k ANS d1 … d5`` close the sequence, and the labels are the
digits: the output at ``ANS`` is scored against ``d1``, the output at ``d1`` against ``d2``, …, at ``d4``
against ``d5``. A sequence of length ``L`` holds ``num_needles`` needles and ``num_queries`` queries.

Depth ``δ`` of the first needle = the fraction of the filler that precedes it (0: at the start, 1: after all
the filler). The other needles are distractors at uniform depths, unless ``num_queries > 1``: the queries ask
for needles ``0 … num_queries - 1`` in a random order (RULER's multi-query variant); the rest stay distractors.
Training draws ``δ`` uniformly; the test sets form the grid ``L{L}_d{δ}`` over ``test_lengths`` × δ ∈ {0, 0.1,
…, 1}. Metric: ``exact_match`` (all five digits of a query right) and ``digit_accuracy``; ``grid`` arranges the
per-set results as the L × δ table.
"""

from __future__ import annotations

import torch

from .base import IGNORE_INDEX, Batch, Task, as_predictions, check_batch, uniform_choice

PAD, KEY, VAL, QRY, ANS, FIRST_DIGIT = 0, 1, 2, 3, 4, 5
FIRST_KEY = FIRST_DIGIT + 10
NEEDLE_LEN = 8  # KEY k VAL d1..d5, and likewise QRY k ANS d1..d5
NUM_DIGITS = 5
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
DEPTHS = tuple(i / 10 for i in range(11))
TEST_MULTIPLIERS = (1, 2, 4, 8, 16)  # default test lengths, in training lengths


def _filler(
    batch_size: int, length: int, source: torch.Tensor, random_window: bool, generator: torch.Generator
) -> torch.Tensor:
    """``[batch_size, length]`` filler bytes: windows of ``source`` (tiled when ``random_window`` is False)."""
    if random_window:
        if source.numel() <= length:
            raise ValueError(f"haystack text has {source.numel()} bytes, fewer than the {length} needed")
        start = torch.randint(0, source.numel() - length, (batch_size, 1), generator=generator)
        return source[start + torch.arange(length)]
    phase = torch.randint(0, source.numel(), (batch_size, 1), generator=generator)
    return source[(phase + torch.arange(length)) % source.numel()]


def passkey_batch(
    batch_size: int,
    seq_len: int,
    depth: float | None,
    num_keys: int,
    num_needles: int,
    num_queries: int,
    source: torch.Tensor,
    random_window: bool,
    generator: torch.Generator,
) -> Batch:
    """``input_ids, labels`` ``[batch_size, seq_len]`` int64; ``depth=None`` draws the depth uniformly."""
    B, m, q = batch_size, num_needles, num_queries
    context = seq_len - NEEDLE_LEN * q
    F = context - NEEDLE_LEN * m
    filler_base = FIRST_KEY + num_keys

    keys = uniform_choice(B, num_keys, m, generator) + FIRST_KEY
    digits = torch.randint(0, 10, (B, m, NUM_DIGITS), generator=generator) + FIRST_DIGIT
    # f[b, j]: filler tokens before needle j.
    f = torch.randint(0, F + 1, (B, m), generator=generator)
    if depth is None:
        f[:, 0] = torch.randint(0, F + 1, (B,), generator=generator)
    else:
        f[:, 0] = round(depth * F)
    f_sorted, order = f.sort(dim=1, stable=True)
    start = f_sorted + torch.arange(m) * NEEDLE_LEN  # start of the needle of rank r
    needles = torch.cat(
        [
            torch.full((B, m, 1), KEY),
            keys.unsqueeze(-1),
            torch.full((B, m, 1), VAL),
            digits,
        ],
        dim=-1,
    ).gather(1, order.unsqueeze(-1).expand(B, m, NEEDLE_LEN))
    pos = (start.unsqueeze(-1) + torch.arange(NEEDLE_LEN)).reshape(B, m * NEEDLE_LEN)
    ctx = torch.zeros(B, context, dtype=torch.int64)
    in_needle = torch.zeros(B, context, dtype=torch.bool)
    ctx.scatter_(1, pos, needles.reshape(B, m * NEEDLE_LEN))
    in_needle.scatter_(1, pos, True)
    filler = _filler(B, F, source, random_window, generator).long() + filler_base
    # The filler fills the remaining positions in order: the k-th free position takes filler[k].
    free_index = ((~in_needle).cumsum(1) - 1).clamp(0, F - 1)
    ctx = torch.where(in_needle, ctx, filler.gather(1, free_index))

    asked = torch.rand(B, q, generator=generator, dtype=torch.float64).argsort(dim=1)
    q_keys, q_digits = keys.gather(1, asked), digits.gather(1, asked.unsqueeze(-1).expand(B, q, NUM_DIGITS))
    queries = torch.cat([torch.full((B, q, 1), QRY), q_keys.unsqueeze(-1), torch.full((B, q, 1), ANS), q_digits], -1)
    q_labels = torch.full((B, q, NEEDLE_LEN), IGNORE_INDEX)
    q_labels[:, :, 2 : 2 + NUM_DIGITS] = q_digits
    input_ids = torch.cat([ctx, queries.reshape(B, q * NEEDLE_LEN)], dim=1)
    labels = torch.cat([torch.full((B, context), IGNORE_INDEX), q_labels.reshape(B, q * NEEDLE_LEN)], dim=1)
    return input_ids, labels


class Passkey(Task):
    """Passkey retrieval. Options: ``seq_len`` (training length, default 512), ``num_keys`` (key names, 64),
    ``num_needles`` (1 + distractors, default 1), ``num_queries`` (default 1), ``haystack`` ("noise" or "text"),
    ``text`` (haystack text for "text"), ``test_lengths`` (default 1, 2, 4, 8 and 16 times ``seq_len``),
    ``test_size`` (sequences per L × δ cell, default 16), ``validation_size`` (sequences at the training length
    and uniform depths, default 256)."""

    name = "passkey"

    def __init__(
        self,
        seed: int = 0,
        seq_len: int = 512,
        num_keys: int = 64,
        num_needles: int = 1,
        num_queries: int = 1,
        haystack: str = "noise",
        text: str | None = None,
        test_lengths: tuple[int, ...] | None = None,
        test_size: int = 16,
        validation_size: int = 256,
    ) -> None:
        super().__init__(seed, validation_size)
        test_lengths = tuple(m * seq_len for m in TEST_MULTIPLIERS) if test_lengths is None else test_lengths
        if not 1 <= num_queries <= num_needles <= num_keys:
            raise ValueError(
                f"need 1 <= num_queries <= num_needles <= num_keys, got {num_queries}, {num_needles}, {num_keys}"
            )
        shortest = min((seq_len, *test_lengths))
        if shortest <= NEEDLE_LEN * (num_needles + num_queries):
            raise ValueError(
                f"length {shortest} leaves no filler around {num_needles} needles and {num_queries} queries"
            )
        if haystack == "noise":
            source = NOISE.encode()
        elif haystack == "text":
            if text is None:
                from .language import load_corpus

                text = "\n".join(load_corpus("default"))
            source = text.encode("utf-8")
        else:
            raise ValueError(f"haystack must be 'noise' or 'text', got {haystack!r}")
        self.source = torch.frombuffer(bytearray(source), dtype=torch.uint8)
        self.random_window = haystack == "text"
        self.seq_len, self.num_keys, self.num_needles, self.num_queries = seq_len, num_keys, num_needles, num_queries
        self.haystack, self.test_lengths, self.test_size = haystack, tuple(test_lengths), test_size
        self.vocab_size = FIRST_KEY + num_keys + 256

    def _batch(self, batch_size: int, seq_len: int, depth: float | None, generator: torch.Generator) -> Batch:
        return passkey_batch(
            batch_size,
            seq_len,
            depth,
            self.num_keys,
            self.num_needles,
            self.num_queries,
            self.source,
            self.random_window,
            generator,
        )

    def sample(self, batch_size: int, generator: torch.Generator) -> Batch:
        return self._batch(batch_size, self.seq_len, None, generator)

    def _build_test_sets(self) -> dict[str, Batch]:
        sets = {}
        for L in self.test_lengths:
            for depth in DEPTHS:
                name = f"L{L}_d{depth:.1f}"
                sets[name] = self._batch(self.test_size, L, depth, self.test_generator(name))
        return sets

    def statistics(self, outputs: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Every sequence carries the same number of queries, each scoring ``NUM_DIGITS`` consecutive labels."""
        check_batch(outputs, labels)
        scored = labels != IGNORE_INDEX
        right = (as_predictions(outputs) == labels)[scored].reshape(-1, NUM_DIGITS)
        return {
            "queries_correct": float(right.all(-1).sum()),
            "queries": float(right.shape[0]),
            "digits_correct": float(right.sum()),
            "digits": float(right.numel()),
        }

    def finalize(self, stats: dict[str, float]) -> dict[str, float]:
        return {
            "exact_match": stats["queries_correct"] / max(stats["queries"], 1.0),
            "digit_accuracy": stats["digits_correct"] / max(stats["digits"], 1.0),
        }


def grid(results: dict[str, dict[str, float]], metric: str = "exact_match") -> dict[int, dict[float, float]]:
    """``{"L{L}_d{δ}": metrics}`` (from ``Passkey.evaluate_model``) -> ``{L: {δ: metric}}``."""
    table: dict[int, dict[float, float]] = {}
    for set_name, metrics in results.items():
        length, depth = set_name[1:].split("_d")
        table.setdefault(int(length), {})[float(depth)] = metrics[metric]
    return table
