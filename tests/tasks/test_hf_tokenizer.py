"""Every task's tokeniser as a PreTrainedTokenizerFast: ids round-trip through text, and it saves and loads."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from attnkit.tasks import TASKS, get_task, make_generator
from attnkit.tasks.hf_tokenizer import SYMBOLS, to_hf_tokenizer

from .test_registry import SMALL

TEXT = "In the beginning: é, ü and 漢字.\n<|endoftext|> twice  spaced\ttab"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "doc.txt"
    rng = torch.Generator().manual_seed(0)
    words = "alpha beta gamma delta épsilon zeta eta theta".split()
    path.write_text(" ".join(words[i] for i in torch.randint(0, 8, (6000,), generator=rng).tolist()), "utf-8")
    return str(path)


def test_every_task_has_a_tokenizer():
    assert set(SYMBOLS) | {"lm"} == set(TASKS)


def _round_trip(tok, ids: torch.Tensor) -> None:
    for row in ids.tolist():
        text = tok.decode(row)
        assert tok(text, add_special_tokens=False)["input_ids"] == row, text


@pytest.mark.parametrize("name", sorted(SYMBOLS))
@pytest.mark.parametrize("options", ["small", "default"])
def test_synthetic_ids_round_trip(tmp_path, name, options):
    task = get_task(name, **(SMALL[name] if options == "small" else {}))
    tok = to_hf_tokenizer(task)
    assert len(tok) == task.vocab_size
    input_ids, labels = task.sample(4, make_generator(0))
    _round_trip(tok, input_ids)
    _round_trip(tok, torch.arange(task.vocab_size).unsqueeze(0))  # every symbol, once
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    _round_trip(loaded, input_ids)
    assert loaded.pad_token == tok.pad_token


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_language_tokenizer_round_trips_text_and_ids(tmp_path, corpus, kind):
    task = get_task("lm", corpus=corpus, tokenizer=kind, bpe_vocab_size=300, seq_len=32)
    tok = to_hf_tokenizer(task)
    assert len(tok) == task.vocab_size and tok.eos_token_id == task.tokenizer.eos_id
    text = TEXT.replace("<|endoftext|>", tok.eos_token)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    plain = TEXT.replace("<|endoftext|>", "")
    assert tok(plain, add_special_tokens=False)["input_ids"] == task.tokenizer.encode(plain)
    if kind == "bpe":
        _round_trip(tok, task.sample(3, make_generator(1))[0])
    else:  # a random window of bytes may cut a UTF-8 character in two: whole texts instead
        assert tok.pad_token_id == task.tokenizer.pad_id
        _round_trip(tok, torch.tensor([task.tokenizer.encode(plain) + [task.tokenizer.eos_id]]))
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(plain, add_special_tokens=False)["input_ids"] == task.tokenizer.encode(plain)
    assert loaded.decode(ids) == text
