"""Group word problems (Merrill et al., "The Illusion of State", arXiv 2404.08819; PaTH Fig. 2).

Input: ``k`` group elements, one token each (token ``i`` is element ``i`` of the group, token 0 the identity).
The label at every position ``t`` is the running product ``g_1 · g_2 ··· g_t``. Metrics: sequence accuracy (all
``k`` labels right) and token accuracy.

Groups are built here from permutations, with no download: ``A5`` (even permutations of 5 points, 60 elements,
non-solvable, so NC¹-complete), ``S5`` (all permutations, 120), ``Z60`` (integers mod 60, the abelian control)
and ``A4xZ5`` (even permutations of 4 points times integers mod 5, 60 elements, the solvable control).
A permutation is a tuple ``p`` with ``p[i]`` the image of ``i``, and ``a · b`` is the composition ``a ∘ b``,
``(a · b)[i] = a[b[i]]``; elements are listed in lexicographic order, so the identity comes first.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from .base import AccuracyTask, Batch


@dataclass(frozen=True)
class Group:
    """A finite group: ``elements`` (hashable, index = token id) and ``table [n, n]`` int64, ``table[a, b] = a·b``."""

    name: str
    elements: tuple
    table: torch.Tensor

    @property
    def order(self) -> int:
        return len(self.elements)


def _is_even(p: Sequence[int]) -> bool:
    inversions = sum(1 for i in range(len(p)) for j in range(i + 1, len(p)) if p[i] > p[j])
    return inversions % 2 == 0


def _compose(a: tuple, b: tuple) -> tuple:
    return tuple(a[i] for i in b)


def _table(elements: Sequence[Hashable], mul: Callable) -> torch.Tensor:
    index = {e: i for i, e in enumerate(elements)}
    return torch.tensor([[index[mul(a, b)] for b in elements] for a in elements], dtype=torch.int64)


@functools.cache
def get_group(name: str) -> Group:
    """One of ``A5``, ``S5``, ``Z60``, ``A4xZ5`` (built once per process)."""
    if name in ("S5", "A5"):
        elements = [p for p in itertools.permutations(range(5)) if name == "S5" or _is_even(p)]
        return Group(name, tuple(elements), _table(elements, _compose))
    if name == "Z60":
        elements = list(range(60))
        return Group(name, tuple(elements), _table(elements, lambda a, b: (a + b) % 60))
    if name == "A4xZ5":
        a4 = [p for p in itertools.permutations(range(4)) if _is_even(p)]
        elements = list(itertools.product(a4, range(5)))
        return Group(name, tuple(elements), _table(elements, lambda a, b: (_compose(a[0], b[0]), (a[1] + b[1]) % 5)))
    raise ValueError(f"unknown group {name!r}; known: {GROUP_NAMES}")


GROUP_NAMES = ("A5", "S5", "Z60", "A4xZ5")


def running_products(words: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``words [B, k]`` element ids -> ``[B, k]`` ids of the prefix products ``g_1···g_t`` (``table[a, b] = a·b``)."""
    n = table.shape[0]
    flat = table.reshape(-1)
    out = torch.zeros_like(words)
    state = words[:, 0]
    out[:, 0] = state
    # The scan is sequential in t but vectorised over the batch: k gathers of B entries.
    for t in range(1, words.shape[1]):
        state = flat[state * n + words[:, t]]
        out[:, t] = state
    return out


class GroupWords(AccuracyTask):
    """Group word problem. Options: ``group`` (one of ``GROUP_NAMES``, default "A5"), ``k`` (word length,
    default 16), ``test_size`` (sequences in the ``test`` set, default 512), ``validation_size`` (default 256).
    Elements are drawn uniformly."""

    name = "group_words"

    def __init__(
        self, seed: int = 0, group: str = "A5", k: int = 16, test_size: int = 512, validation_size: int = 256
    ) -> None:
        super().__init__(seed, validation_size)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.group = get_group(group)
        self.vocab_size = self.group.order
        self.seq_len = self.k = k
        self.test_size = test_size

    def _words(self, batch_size: int, generator: torch.Generator) -> Batch:
        words = torch.randint(0, self.group.order, (batch_size, self.k), generator=generator)
        return words, running_products(words, self.group.table)

    def sample(self, batch_size: int, generator: torch.Generator) -> Batch:
        return self._words(batch_size, generator)

    def _build_test_sets(self) -> dict[str, Batch]:
        return {"test": self._words(self.test_size, self.test_generator(f"{self.group.name}/k{self.k}"))}
