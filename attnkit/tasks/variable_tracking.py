"""Variable tracking in the style of RULER's multi-hop tracing task (Hsieh et al., arXiv 2404.06654, "VT").

Vocabulary (``vocab_size = 15 + num_vars + 256``):

==========================  ==============================================================
id                          token
==========================  ==============================================================
0                           ``PAD`` (unused by the generator; free for padding)
1, 2, 3, 4                  ``VAR``, ``=``, ``QRY``, ``ANS``
5 … 14                      the digits 0 … 9
15 … 15 + num_vars - 1      variable names
15 + num_vars + b           filler byte ``b`` (0 … 255)
==========================  ==============================================================

A sequence holds ``num_chains`` chains of ``num_hops`` hops. A chain is the assignment of a five-digit value,
``VAR X0 = d1 d2 d3 d4 d5`` (8 tokens), followed by ``num_hops`` copies ``VAR X1 = X0``, ``VAR X2 = X1``, …
(4 tokens each), so all ``num_hops + 1`` variables of the chain hold its value. Every chain has its own value
and its own variables (all names of a sequence are distinct). The statements of all chains are interleaved at
random (each chain's in its own order) and placed at uniform random positions in a haystack of filler: RULER's
noise sentence, repeated from a random phase.

The query, RULER's form (``query="variables"``): *which variables hold the value V?* ``QRY d1 … d5 ANS X0 X1 …
Xh``: the labels are the chain's variables in the order they were assigned: the output at ``ANS`` is scored
against ``X0``, the output at ``X0`` against ``X1``, …, at ``X(h-1)`` against ``Xh``. RULER scores the set of
names by string matching; a next-token model states them in some order, and the order of assignment is the one
the text defines. ``query="value"`` (the form in ``TASKS.md``): *what value does the last variable hold?*
``QRY Xh ANS d1 … d5``, the labels the digits. ``num_queries`` (at most ``num_chains``) queries close the
sequence, each asking about another chain, in random order; the chains not asked about are distractors.

Test sets ``L{L}`` for each of ``test_lengths`` (default 1, 2, 4, 8 and 16 times ``seq_len``), ``test_size``
sequences each: the same statements and queries in a longer haystack. Metric: ``exact_match`` (a query's whole
answer right, as in passkey) and ``accuracy`` (per answer token).
"""

from __future__ import annotations

import torch

from .base import IGNORE_INDEX, Batch, Task, as_predictions, check_batch, uniform_choice

PAD, VAR, EQ, QRY, ANS, FIRST_DIGIT = 0, 1, 2, 3, 4, 5
FIRST_VAR = FIRST_DIGIT + 10
NUM_DIGITS = 5
VALUE_LEN = 3 + NUM_DIGITS  # VAR X = d1 … d5
COPY_LEN = 4  # VAR Y = X
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUERIES = ("variables", "value")
TEST_MULTIPLIERS = (1, 2, 4, 8, 16)  # default test lengths, in training lengths


def query_len(num_hops: int, query: str) -> int:
    """Tokens of one query with its answer: ``QRY d1…d5 ANS X0…Xh`` or ``QRY Xh ANS d1…d5``."""
    return 2 + NUM_DIGITS + num_hops + 1 if query == "variables" else 3 + NUM_DIGITS


def _distinct_values(batch_size: int, num_chains: int, generator: torch.Generator) -> torch.Tensor:
    """``[batch_size, num_chains]`` integers in ``[0, 10^5)``, distinct within each row."""
    values = torch.randint(0, 10**NUM_DIGITS, (batch_size, num_chains), generator=generator)
    while num_chains > 1:
        ordered = values.sort(-1).values
        repeated = (ordered[:, 1:] == ordered[:, :-1]).any(-1)
        if not repeated.any():
            break
        values[repeated] = torch.randint(0, 10**NUM_DIGITS, (int(repeated.sum()), num_chains), generator=generator)
    return values


def variable_tracking_batch(
    batch_size: int,
    seq_len: int,
    num_vars: int,
    num_chains: int,
    num_hops: int,
    num_queries: int,
    query: str,
    generator: torch.Generator,
) -> Batch:
    """``input_ids, labels`` ``[batch_size, seq_len]`` int64 (see the module docstring for the layout)."""
    B, c, S, q = batch_size, num_chains, num_hops + 1, num_queries
    names = uniform_choice(B, num_vars, c * S, generator).view(B, c, S) + FIRST_VAR
    number = _distinct_values(B, c, generator)
    digits = number.unsqueeze(-1) // 10 ** torch.arange(NUM_DIGITS - 1, -1, -1) % 10 + FIRST_DIGIT  # [B, c, 5]

    # statement j of chain i, padded to VALUE_LEN: VAR X_j = (the value if j == 0 else X_{j-1})
    statements = torch.full((B, c, S, VALUE_LEN), PAD)
    statements[..., 0], statements[..., 1], statements[..., 2] = VAR, names, EQ
    statements[:, :, 0, 3:] = digits
    statements[:, :, 1:, 3] = names[:, :, :-1]
    lengths = torch.full((c, S), COPY_LEN)
    lengths[:, 0] = VALUE_LEN
    # A uniform interleaving that keeps each chain in order: iid keys, sorted within each chain.
    keys = torch.rand(B, c, S, generator=generator, dtype=torch.float64).sort(-1).values
    order = keys.view(B, c * S).argsort(-1)  # the statement of rank r in the text
    statements = statements.view(B, c * S, VALUE_LEN).gather(1, order.unsqueeze(-1).expand(-1, -1, VALUE_LEN))
    lengths = lengths.view(-1)[order]  # [B, c * S]

    n_tokens = c * (VALUE_LEN + num_hops * COPY_LEN)
    context = seq_len - q * query_len(num_hops, query)
    F = context - n_tokens
    before = torch.randint(0, F + 1, (B, c * S), generator=generator).sort(-1).values  # filler before rank r
    start = before + lengths.cumsum(-1) - lengths
    valid = torch.arange(VALUE_LEN) < lengths.unsqueeze(-1)
    pos = (start.unsqueeze(-1) + torch.arange(VALUE_LEN))[valid].view(B, n_tokens)
    ctx = torch.zeros(B, context, dtype=torch.int64)
    in_statement = torch.zeros(B, context, dtype=torch.bool)
    ctx.scatter_(1, pos, statements[valid].view(B, n_tokens))
    in_statement.scatter_(1, pos, True)
    noise = torch.tensor(list(NOISE.encode()))
    phase = torch.randint(0, noise.numel(), (B, 1), generator=generator)
    filler = noise[(phase + torch.arange(F)) % noise.numel()] + FIRST_VAR + num_vars
    # The filler fills the free positions in order: the k-th free position takes filler[k].
    free_index = ((~in_statement).cumsum(1) - 1).clamp(0, F - 1)
    ctx = torch.where(in_statement, ctx, filler.gather(1, free_index))

    asked = torch.rand(B, c, generator=generator, dtype=torch.float64).argsort(-1)[:, :q]  # [B, q] chains
    q_names = names.gather(1, asked.unsqueeze(-1).expand(B, q, S))
    q_digits = digits.gather(1, asked.unsqueeze(-1).expand(B, q, NUM_DIGITS))
    qry, ans = torch.full((B, q, 1), QRY), torch.full((B, q, 1), ANS)
    if query == "variables":
        block = torch.cat([qry, q_digits, ans, q_names], -1)
        answer, first = q_names, 1 + NUM_DIGITS  # the output at ANS gives X0
    else:
        block = torch.cat([qry, q_names[..., -1:], ans, q_digits], -1)
        answer, first = q_digits, 2  # the output at ANS gives d1
    block_labels = torch.full_like(block, IGNORE_INDEX)
    block_labels[..., first : first + answer.shape[-1]] = answer
    input_ids = torch.cat([ctx, block.view(B, -1)], dim=1)
    labels = torch.cat([torch.full((B, context), IGNORE_INDEX), block_labels.view(B, -1)], dim=1)
    return input_ids, labels


class VariableTracking(Task):
    """Variable tracking. Options: ``seq_len`` (training length, default 512), ``num_vars`` (variable names,
    default 64), ``num_chains`` (default 1, RULER's), ``num_hops`` (default 4, RULER's), ``num_queries`` (default
    1), ``query`` ("variables", RULER's form, or "value"), ``test_lengths`` (default 1, 2, 4, 8 and 16 times
    ``seq_len``), ``test_size`` (sequences per length, default 128), ``validation_size`` (sequences at the
    training length, default 256)."""

    name = "variable_tracking"

    def __init__(
        self,
        seed: int = 0,
        seq_len: int = 512,
        num_vars: int = 64,
        num_chains: int = 1,
        num_hops: int = 4,
        num_queries: int = 1,
        query: str = "variables",
        test_lengths: tuple[int, ...] | None = None,
        test_size: int = 128,
        validation_size: int = 256,
    ) -> None:
        super().__init__(seed, validation_size)
        counts = dict(seq_len=seq_len, num_chains=num_chains, num_hops=num_hops, num_queries=num_queries)
        for name, value in {**counts, "test_size": test_size}.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if query not in QUERIES:
            raise ValueError(f"query: expected one of {QUERIES}, got {query!r}")
        if num_queries > num_chains:
            raise ValueError(f"num_queries: {num_queries} queries ask about distinct chains, only {num_chains} exist")
        if isinstance(num_vars, bool) or not isinstance(num_vars, int) or num_vars < num_chains * (num_hops + 1):
            raise ValueError(
                f"num_vars: {num_chains} chains of {num_hops} hops need {num_chains * (num_hops + 1)} distinct "
                f"names, got {num_vars!r}"
            )
        test_lengths = tuple(m * seq_len for m in TEST_MULTIPLIERS) if test_lengths is None else tuple(test_lengths)
        if not test_lengths or any(isinstance(L, bool) or not isinstance(L, int) for L in test_lengths):
            raise ValueError(f"test_lengths: expected a tuple of integers, got {test_lengths!r}")
        needed = num_chains * (VALUE_LEN + num_hops * COPY_LEN) + num_queries * query_len(num_hops, query)
        shortest = min((seq_len, *test_lengths))
        if shortest <= needed:
            raise ValueError(
                f"seq_len, test_lengths: length {shortest} leaves no filler around the {needed} tokens of "
                f"{num_chains} chains and {num_queries} queries"
            )
        self.seq_len, self.num_vars, self.num_chains, self.num_hops = seq_len, num_vars, num_chains, num_hops
        self.num_queries, self.query, self.test_lengths, self.test_size = num_queries, query, test_lengths, test_size
        self.answer_len = num_hops + 1 if query == "variables" else NUM_DIGITS
        self.vocab_size = FIRST_VAR + num_vars + 256

    def _batch(self, batch_size: int, seq_len: int, generator: torch.Generator) -> Batch:
        return variable_tracking_batch(
            batch_size,
            seq_len,
            self.num_vars,
            self.num_chains,
            self.num_hops,
            self.num_queries,
            self.query,
            generator,
        )

    def sample(self, batch_size: int, generator: torch.Generator) -> Batch:
        return self._batch(batch_size, self.seq_len, generator)

    def _build_test_sets(self) -> dict[str, Batch]:
        return {f"L{L}": self._batch(self.test_size, L, self.test_generator(f"L{L}")) for L in self.test_lengths}

    def statistics(self, outputs: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Every sequence carries the same number of queries, each scoring ``answer_len`` consecutive labels."""
        check_batch(outputs, labels)
        scored = labels != IGNORE_INDEX
        right = (as_predictions(outputs) == labels)[scored].reshape(-1, self.answer_len)
        return {
            "queries_correct": float(right.all(-1).sum()),
            "queries": float(right.shape[0]),
            "tokens_correct": float(right.sum()),
            "tokens": float(right.numel()),
        }

    def finalize(self, stats: dict[str, float]) -> dict[str, float]:
        return {
            "exact_match": stats["queries_correct"] / max(stats["queries"], 1.0),
            "accuracy": stats["tokens_correct"] / max(stats["tokens"], 1.0),
        }
