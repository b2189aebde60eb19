"""Every task's tokeniser as a ``transformers.PreTrainedTokenizerFast``, saved beside a trained model.

- ``lm``: its byte tokeniser (ids 0-255 the UTF-8 bytes, then ``<|endoftext|>`` and ``<pad>``) or its BPE, so
  ``decode`` gives the text back and ``encode`` the ids the task trained on.
- the synthetic tasks: a word-level tokeniser over the task's symbols (``task_symbols``), one whitespace-free
  word per id, so ``encode(decode(ids)) == ids`` for every id sequence the task makes.
"""

from __future__ import annotations

from collections.abc import Callable

from .base import Task
from .copying import NUM_LETTERS
from .mqar import VLA_NUM_KEYS, VLA_SEP
from .text_tokenizers import EOS_TEXT, BPETokenizer, ByteTokenizer

PAD_TEXT = "<pad>"


def _flipflop(task) -> list[str]:
    return ["w", "r", "i", "0", "1"]


def _element(e) -> str:
    """A group element as one word: a permutation as its images, ``(permutation, n)`` as ``images+n``."""
    if isinstance(e, int):
        return str(e)
    if all(isinstance(i, int) for i in e):
        return "".join(map(str, e))
    return "+".join(_element(part) for part in e)


def _group_words(task) -> list[str]:
    return [_element(e) for e in task.group.elements]


def _mqar(task) -> list[str]:
    half = task.vocab_size // 2
    return ["_"] + [f"k{i}" for i in range(1, half)] + [f"v{i - half}" for i in range(half, task.vocab_size)]


def _mqar_vla(task) -> list[str]:
    keys = [f"k{i}" for i in range(VLA_NUM_KEYS)]
    return keys + [f"v{i - VLA_NUM_KEYS}" for i in range(VLA_NUM_KEYS, VLA_SEP)] + ["|"]


def _mqrar(task) -> list[str]:
    return ["|"] + [f"k{i}" for i in range(task.num_keys)] + [f"v{i}" for i in range(task.num_values)]


def _copying(task) -> list[str]:
    return [PAD_TEXT, "$", "|", "."] + [chr(ord("a") + i) for i in range(NUM_LETTERS)]


def _passkey(task) -> list[str]:
    names = [PAD_TEXT, "KEY", "VAL", "QRY", "ANS"] + [str(d) for d in range(10)]  # ids 0 ... FIRST_KEY - 1
    return names + [f"k{i}" for i in range(task.num_keys)] + [f"<0x{b:02X}>" for b in range(256)]


def _variable_tracking(task) -> list[str]:
    names = [PAD_TEXT, "VAR", "=", "QRY", "ANS"] + [str(d) for d in range(10)]  # ids 0 ... FIRST_VAR - 1
    return names + [f"x{i}" for i in range(task.num_vars)] + [f"<0x{b:02X}>" for b in range(256)]


SYMBOLS: dict[str, Callable[[Task], list[str]]] = {
    "flipflop": _flipflop,
    "group_words": _group_words,
    "mqar": _mqar,
    "mqar_vla": _mqar_vla,
    "mqrar": _mqrar,
    "copying": _copying,
    "passkey": _passkey,
    "variable_tracking": _variable_tracking,
}


def task_symbols(task: Task) -> list[str]:
    """The word of every id of a synthetic task (``len == task.vocab_size``)."""
    if task.name not in SYMBOLS:
        raise ValueError(f"task: {task.name!r} has no symbol table; known: {sorted(SYMBOLS)}")
    symbols = SYMBOLS[task.name](task)
    if len(symbols) != task.vocab_size or len(set(symbols)) != len(symbols):
        raise ValueError(f"task: the symbols of {task.name!r} do not name its {task.vocab_size} ids one to one")
    return symbols


def _byte_backend():
    """A ``tokenizers.Tokenizer`` that maps text to its UTF-8 bytes (ids 0-255), then EOS (256) and PAD (257)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    # The byte-level pre-tokeniser writes byte b as the character GPT-2's byte-to-unicode table gives it:
    # printable Latin-1 bytes as themselves, the others as chr(256 + n) in byte order.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS_TEXT, special=True), AddedToken(PAD_TEXT, special=True)])
    return tok


def _word_backend(symbols: list[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={s: i for i, s in enumerate(symbols)}, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def to_hf_tokenizer(task: Task):
    """``task``'s tokeniser as a ``PreTrainedTokenizerFast`` (its ids are the task's ids; see the module doc)."""
    from transformers import PreTrainedTokenizerFast

    special: dict[str, str] = {}
    tokenizer = getattr(task, "tokenizer", None)
    if isinstance(tokenizer, ByteTokenizer):
        backend = _byte_backend()
        special = {"eos_token": EOS_TEXT, "pad_token": PAD_TEXT}
    elif isinstance(tokenizer, BPETokenizer):
        backend = tokenizer.backend
        special = {"eos_token": EOS_TEXT, "pad_token": EOS_TEXT}
    else:
        symbols = task_symbols(task)
        backend = _word_backend(symbols)
        if symbols[0] == PAD_TEXT:
            special = {"pad_token": PAD_TEXT}
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False, **special)
    if len(hf) != task.vocab_size:
        raise ValueError(f"task: its tokeniser has {len(hf)} tokens, the task {task.vocab_size}")
    return hf
