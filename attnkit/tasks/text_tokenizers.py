"""Tokenisers for the language-modelling task: raw bytes, or a byte-level BPE trained locally.

Both map ``str -> list[int]`` and back and have ``vocab_size`` and ``eos_id`` (the document separator).
The BPE uses the ``tokenizers`` package (the ``hf`` extra), imported only when a BPE is built.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

EOS_TEXT = "<|endoftext|>"


class ByteTokenizer:
    """UTF-8 bytes: ids 0-255, then ``eos_id = 256`` and ``pad_id = 257`` (``vocab_size = 258``)."""

    eos_id = 256
    pad_id = 257
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class BPETokenizer:
    """A byte-level BPE (GPT-2 style pre-tokenisation) with one special token, ``<|endoftext|>`` (id 0)."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self.eos_id = tokenizer.token_to_id(EOS_TEXT)
        self.vocab_size = tokenizer.get_vocab_size()

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 4096) -> BPETokenizer:
        """Learn ``vocab_size`` tokens (256 bytes + EOS + merges) from ``texts``."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOS_TEXT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(path))

    @property
    def backend(self):
        """A copy of the ``tokenizers.Tokenizer`` behind it."""
        from tokenizers import Tokenizer

        return Tokenizer.from_str(self._tok.to_str())

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids))
