"""Multi-query associative recall: the Zoology form (Arora et al., arXiv 2312.04927) and the VLA form (2605.11196).

Zoology form (``MQAR``, registry name "mqar"): vocabulary ``V``, length ``L``, ``n`` pairs. Keys are ``n``
distinct ids from ``[1, V/2)``, values ``n`` distinct ids from ``[V/2, V)``. The context ``k1 v1 … kn vn`` fills
positions ``0 … 2n-1``; the rest is a query region of zeros in which each key appears once, at position
``2n + 2g`` for a gap ``g`` in ``[0, (L - 2n)/2)``, the gaps drawn without replacement with
``p(g) ∝ (g + 1)^(α - 1)``, ``α = 0.01``. As in Zoology's generator (whose inputs and labels are the shifted
halves of one array), the label sits on the key's query position and is that key's value; every other label
is -100. ``random_non_queries=True`` replaces the zeros of the query region by uniform random tokens, the
option Zoology's code has.

VLA form (``MQARVLA``, registry name "mqar_vla"): vocabulary 128 with separator 127, ``k1 v1 … kn vn SEP
q1 … qn`` (``T = 3n + 1``). Keys are ``n`` distinct ids from ``[0, 64)``, values uniform over ``[64, 127)``
(our split of the vocabulary, so a value is never mistaken for a key), the queries are drawn uniformly from
the stored keys, and the label sits on each query token: that key's value. With ``seq_len`` longer than
``3n + 1`` (the paper's retention variant), ``T - 2n - 1`` queries fill the rest of the sequence.

Metric of both: accuracy over the query positions (``accuracy``), plus ``sequence_accuracy``.
"""

from __future__ import annotations

import torch

from .base import IGNORE_INDEX, AccuracyTask, Batch, uniform_choice


def zoology_mqar(
    batch_size: int,
    seq_len: int,
    num_kv_pairs: int,
    vocab_size: int,
    generator: torch.Generator,
    power_a: float = 0.01,
    random_non_queries: bool = False,
) -> Batch:
    """Zoology MQAR batch: ``input_ids, labels`` ``[batch_size, seq_len]`` int64."""
    B, n, L, V = batch_size, num_kv_pairs, seq_len, vocab_size
    keys = uniform_choice(B, V // 2 - 1, n, generator) + 1
    values = uniform_choice(B, V - V // 2, n, generator) + V // 2
    space = (L - 2 * n) // 2
    p = torch.arange(1, space + 1, dtype=torch.float64).pow(power_a - 1)
    gaps = torch.multinomial(p.expand(B, space), n, replacement=False, generator=generator)

    input_ids = torch.zeros(B, L, dtype=torch.int64)
    input_ids[:, 0 : 2 * n : 2] = keys
    input_ids[:, 1 : 2 * n : 2] = values
    query_pos = 2 * n + 2 * gaps
    if random_non_queries:
        noise = torch.randint(0, V, (B, L - 2 * n), generator=generator)
        input_ids[:, 2 * n :] = noise
    input_ids.scatter_(1, query_pos, keys)
    labels = torch.full((B, L), IGNORE_INDEX, dtype=torch.int64)
    labels.scatter_(1, query_pos, values)
    return input_ids, labels


class MQAR(AccuracyTask):
    """Zoology MQAR. Options: ``seq_len`` (L, default 256), ``num_kv_pairs`` (n, default 16), ``vocab_size``
    (V, default 8192), ``power_a`` (α, default 0.01), ``random_non_queries`` (default False), ``test_size``
    (default 512), ``validation_size`` (default 256). Zoology's sweep: (L, n) in {(64,4), (128,8), (256,16),
    (256,32), (512,64)}."""

    name = "mqar"

    def __init__(
        self,
        seed: int = 0,
        seq_len: int = 256,
        num_kv_pairs: int = 16,
        vocab_size: int = 8192,
        power_a: float = 0.01,
        random_non_queries: bool = False,
        test_size: int = 512,
        validation_size: int = 256,
    ) -> None:
        super().__init__(seed, validation_size)
        if seq_len % 2:
            raise ValueError(f"seq_len must be even, got {seq_len}")
        if 4 * num_kv_pairs > seq_len:
            raise ValueError(f"need 4 * num_kv_pairs <= seq_len, got {num_kv_pairs} pairs in {seq_len}")
        if vocab_size // 2 - 1 < num_kv_pairs:
            raise ValueError(f"vocab_size {vocab_size} has too few keys for {num_kv_pairs} pairs")
        self.seq_len, self.num_kv_pairs, self.vocab_size = seq_len, num_kv_pairs, vocab_size
        self.power_a, self.random_non_queries, self.test_size = power_a, random_non_queries, test_size

    def sample(self, batch_size: int, generator: torch.Generator) -> Batch:
        return zoology_mqar(
            batch_size,
            self.seq_len,
            self.num_kv_pairs,
            self.vocab_size,
            generator,
            power_a=self.power_a,
            random_non_queries=self.random_non_queries,
        )

    def _build_test_sets(self) -> dict[str, Batch]:
        name = f"L{self.seq_len}_n{self.num_kv_pairs}"
        return {name: self.sample(self.test_size, self.test_generator(name))}


VLA_VOCAB, VLA_SEP, VLA_NUM_KEYS = 128, 127, 64


def vla_mqar(batch_size: int, num_kv_pairs: int, generator: torch.Generator, num_queries: int | None = None) -> Batch:
    """VLA-form MQAR batch: ``input_ids, labels`` ``[batch_size, 2n + 1 + Q]`` int64, ``Q = num_queries``
    (default ``n``, so ``T = 3n + 1``)."""
    B, n = batch_size, num_kv_pairs
    Q = n if num_queries is None else num_queries
    keys = uniform_choice(B, VLA_NUM_KEYS, n, generator)
    values = torch.randint(VLA_NUM_KEYS, VLA_SEP, (B, n), generator=generator)
    which = torch.randint(0, n, (B, Q), generator=generator)
    input_ids = torch.zeros(B, 2 * n + 1 + Q, dtype=torch.int64)
    input_ids[:, 0 : 2 * n : 2] = keys
    input_ids[:, 1 : 2 * n : 2] = values
    input_ids[:, 2 * n] = VLA_SEP
    input_ids[:, 2 * n + 1 :] = keys.gather(1, which)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, 2 * n + 1 :] = values.gather(1, which)
    return input_ids, labels


class MQARVLA(AccuracyTask):
    """VLA-form MQAR. Options: ``num_kv_pairs`` (n <= 64, default 8; the paper uses 4/8/12/16/24),
    ``test_size`` (default 512), ``validation_size`` (default 256), ``seq_len`` (T; default ``3n + 1``, one query
    per pair; a longer T is the paper's retention variant: the ``T - 2n - 1`` queries fill the rest of the
    sequence, each drawn uniformly from the stored keys). The test set is ``n{n}``, or ``n{n}_T{T}`` for a
    ``seq_len`` other than ``3n + 1``."""

    name = "mqar_vla"
    vocab_size = VLA_VOCAB

    def __init__(
        self,
        seed: int = 0,
        num_kv_pairs: int = 8,
        test_size: int = 512,
        validation_size: int = 256,
        seq_len: int | None = None,
    ) -> None:
        super().__init__(seed, validation_size)
        if not 1 <= num_kv_pairs <= VLA_NUM_KEYS:
            raise ValueError(f"num_kv_pairs must lie in [1, {VLA_NUM_KEYS}], got {num_kv_pairs}")
        default_len = 3 * num_kv_pairs + 1
        if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int)):
            raise ValueError(f"seq_len: expected an integer or None, got {seq_len!r}")
        if seq_len is not None and seq_len < 2 * num_kv_pairs + 2:
            need = 2 * num_kv_pairs + 2
            raise ValueError(f"seq_len: {num_kv_pairs} pairs need T >= {need} (one query), got {seq_len}")
        self.num_kv_pairs, self.test_size = num_kv_pairs, test_size
        self.seq_len = default_len if seq_len is None else seq_len
        self.num_queries = self.seq_len - 2 * num_kv_pairs - 1

    def sample(self, batch_size: int, generator: torch.Generator) -> Batch:
        return vla_mqar(batch_size, self.num_kv_pairs, generator, self.num_queries)

    def _build_test_sets(self) -> dict[str, Batch]:
        name = f"n{self.num_kv_pairs}"
        if self.seq_len != 3 * self.num_kv_pairs + 1:
            name += f"_T{self.seq_len}"
        return {name: self.sample(self.test_size, self.test_generator(name))}
