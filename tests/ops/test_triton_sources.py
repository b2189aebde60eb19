"""Source rules for the Triton kernels that the interpreter on CPU cannot check: the GPU runs Triton 3.6, whose
JIT rejects some Python the interpreter (Triton >= 3.9) accepts.

- A nested tuple target (``a, (b, c) = ...``) in a ``@triton.jit`` function: Triton 3.6's dependency finder
  (``visitAssnTarget``) puts the inner names in a set as a list and fails with "unhashable type: 'list'" at the
  kernel's first launch. It cost a GPU run (the PaTH-FoX model and FoX's gradient check failed on an H200).
- ``tl.make_block_ptr`` (removed in Triton 3.9, so the interpreter here would fail anyway).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "attnkit"
SOURCES = sorted(p for p in ROOT.rglob("*.py") if "triton.jit" in p.read_text())


def jit_functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
            yield node


def nested_targets(fn: ast.FunctionDef) -> list[int]:
    lines = []
    for node in ast.walk(fn):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.For) else []
        for target in targets:
            if isinstance(target, ast.Tuple) and any(isinstance(e, (ast.Tuple, ast.List)) for e in target.elts):
                lines.append(node.lineno)
    return lines


def test_the_rules_find_kernels():
    assert len(SOURCES) >= 15, SOURCES
    bad = ast.parse("import triton\n@triton.jit\ndef k(x):\n    a, (b, c) = 0, (1, 2)\n")
    assert [nested_targets(f) for f in jit_functions(bad)] == [[4]]


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(ROOT)) for p in SOURCES])
def test_kernels_use_python_that_triton_3_6_compiles(path):
    tree = ast.parse(path.read_text())
    bad = {fn.name: lines for fn in jit_functions(tree) if (lines := nested_targets(fn))}
    assert not bad, f"{path.name}: nested tuple targets (Triton 3.6 fails on them) in {bad}"
    assert "make_block_ptr" not in path.read_text()
