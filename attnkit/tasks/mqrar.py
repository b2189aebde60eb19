"""MQRAR-N: multi-query repeated associative recall (PaTH, arXiv 2505.16381, §4.1).

Keys are re-assigned several times and a query asks for the value its key had ``N`` assignments ago
(``N = 1``: the most recent, which is MQAR with overwrites; ``N = 2``: the one before, and so on).

Layout (our concrete form of the paper's description): ``k v k v … k v SEP q1 … qQ`` with ``P`` assignments,
``T = 2P + 1 + Q``. Token 0 is ``SEP``, keys are ``1 … num_keys``, values ``num_keys + 1 … num_keys +
num_values``. Every key is assigned at least ``N`` times (``N`` assignments of each key, the rest uniform over
the keys, all shuffled, so the assignments of different keys interleave); values are uniform. Queries are
drawn uniformly from the keys, and the label sits on each query token: the ``N``-th most recent value of its
key. Metric: accuracy over the queries (plus ``sequence_accuracy``).

Defaults: 32 keys, length 768, 63 queries (so ``P = 352``, about 11 assignments a key), 128 values.
"""

from __future__ import annotations

import torch

from .base import IGNORE_INDEX, AccuracyTask, Batch

SEP = 0


def mqrar(
    batch_size: int,
    num_assignments: int,
    num_queries: int,
    num_keys: int,
    num_values: int,
    n_back: int,
    generator: torch.Generator,
) -> Batch:
    """MQRAR-N batch: ``input_ids, labels`` ``[batch_size, 2 * num_assignments + 1 + num_queries]`` int64."""
    B, P, K = batch_size, num_assignments, num_keys
    guaranteed = torch.arange(K).repeat(n_back).expand(B, K * n_back)
    extra = torch.randint(0, K, (B, P - K * n_back), generator=generator)
    order = torch.rand(B, P, generator=generator, dtype=torch.float64).argsort(dim=1)
    keys = torch.cat([guaranteed, extra], dim=1).gather(1, order)
    values = torch.randint(0, num_values, (B, P), generator=generator)

    # Sort the assignments by (key, position): each key's assignments end up contiguous and in order, so its
    # N-th most recent one sits N - 1 places before the end of its group.
    by_key = (keys * P + torch.arange(P)).argsort(dim=1)
    counts = torch.zeros(B, K, dtype=torch.int64).scatter_add_(1, keys, torch.ones_like(keys))
    nth_index = by_key.gather(1, counts.cumsum(1) - n_back)
    nth = values.gather(1, nth_index)

    queries = torch.randint(0, K, (B, num_queries), generator=generator)
    value_base = 1 + K
    input_ids = torch.cat(
        [
            torch.stack([keys + 1, values + value_base], dim=-1).reshape(B, 2 * P),
            torch.full((B, 1), SEP, dtype=torch.int64),
            queries + 1,
        ],
        dim=1,
    )
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, 2 * P + 1 :] = nth.gather(1, queries) + value_base
    return input_ids, labels


class MQRAR(AccuracyTask):
    """MQRAR-N. Options: ``n_back`` (N, default 2), ``seq_len`` (default 768), ``num_keys`` (32),
    ``num_queries`` (63; ``seq_len - 1 - num_queries`` must be even), ``num_values`` (128), ``test_size`` (512),
    ``validation_size`` (256)."""

    name = "mqrar"

    def __init__(
        self,
        seed: int = 0,
        n_back: int = 2,
        seq_len: int = 768,
        num_keys: int = 32,
        num_queries: int = 63,
        num_values: int = 128,
        test_size: int = 512,
        validation_size: int = 256,
    ) -> None:
        super().__init__(seed, validation_size)
        context = seq_len - 1 - num_queries
        if num_queries < 1 or context <= 0 or context % 2:
            raise ValueError(f"seq_len - 1 - num_queries must be positive and even, got {seq_len} - 1 - {num_queries}")
        if n_back < 1 or num_keys * n_back > context // 2:
            raise ValueError(
                f"n_back={n_back} needs num_keys * n_back <= {context // 2} assignments (num_keys={num_keys})"
            )
        self.n_back, self.seq_len, self.num_keys = n_back, seq_len, num_keys
        self.num_queries, self.num_values, self.test_size = num_queries, num_values, test_size
        self.num_assignments = context // 2
        self.vocab_size = 1 + num_keys + num_values

    def sample(self, batch_size: int, generator: torch.Generator) -> Batch:
        return mqrar(
            batch_size,
            self.num_assignments,
            self.num_queries,
            self.num_keys,
            self.num_values,
            self.n_back,
            generator,
        )

    def _build_test_sets(self) -> dict[str, Batch]:
        name = f"N{self.n_back}"
        return {name: self.sample(self.test_size, self.test_generator(name))}
