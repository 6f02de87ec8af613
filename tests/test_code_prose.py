"""The code's prose rules: a module docstring states its module's purpose and contract in at most 10
lines (a kernel may add a floor block of at most 3), and no comment or docstring in strata/ cites a commit hash, an
issue number or a measured time. Measurements belong in docs/performance.md, long format specs in docs/formats.md."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

STRATA = Path(__file__).resolve().parents[1] / "strata"
FILES = sorted(STRATA.rglob("*.py"))
MODULE_DOC_LINES = 10
FLOOR_LINES = 3          # a kernel module's "Floor ..." paragraph: the bound it aims at, from hardware figures

# 7-40 hex digits holding both a digit and a letter, not part of a longer word or number (9.99999997e-07 is a float)
HASH = re.compile(r"(?<![\w.])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?!\w)")
ISSUE = re.compile(r"\bissue\s?#?\d", re.IGNORECASE)
# a duration (0.25 ms, ~35 us, 2 s) or a throughput (5.2 GB/s, 300 tok/s)
TIME = re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|us|µs|ns)\b|\b\d+(?:\.\d+)? s\b|\b\d+(?:\.\d+)?\s?(?:[KMG]B/s|tok/s)")
RULES = (("commit hash", HASH), ("issue number", ISSUE), ("measured time", TIME))


def _docstrings(tree: ast.Module):
    """(node, the docstring's Constant) of the module and of every class and function that has one."""
    for node in ast.walk(tree):                     # the module first
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                yield node, first.value


def _floor_block(path: Path, doc: str) -> list[str]:
    """The lines of a kernel module docstring's paragraph that starts with "Floor", else []."""
    if path.parent.name != "kernels":
        return []
    for para in doc.split("\n\n"):
        if para.lstrip().startswith("Floor"):
            return para.strip("\n").splitlines()
    return []


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring line of a file; a kernel's floor block is left out (its figures are
    arithmetic on hardware figures, not measurements; its length is held by test_module_docstrings_are_short)."""
    src = path.read_text()
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(src).readline)
           if t.type == tokenize.COMMENT]
    tree = ast.parse(src)
    for node, const in _docstrings(tree):
        floor = set(_floor_block(path, const.value)) if node is tree else set()
        out += [(const.lineno + i, line) for i, line in enumerate(const.value.splitlines()) if line not in floor]
    return sorted(out)


def test_module_docstrings_are_short():
    long = []
    for path in FILES:
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if not doc:
            continue
        n, floor = len(doc.splitlines()), len(_floor_block(path, doc))
        if n - floor > MODULE_DOC_LINES or floor > FLOOR_LINES:
            long.append(f"{path.relative_to(STRATA.parent)}: {n} lines" + (f" ({floor} of them its floor block)"
                                                                            if floor else ""))
    assert not long, (f"module docstrings over {MODULE_DOC_LINES} lines (a kernel's floor block: {FLOOR_LINES} more); "
                      f"cut them to purpose and contract, move specs to docs/formats.md:\n" + "\n".join(long))


def test_no_hashes_issues_or_measured_times_in_comments_and_docstrings():
    hits = []
    for path in FILES:
        for line, text in _prose(path):
            for what, rx in RULES:
                if m := rx.search(text):
                    hits.append(f"{path.relative_to(STRATA.parent)}:{line}: {what} {m.group(0)!r}: {text.strip()}")
    assert not hits, ("comments and docstrings cite history or measurements; move them to docs/performance.md "
                      "(or drop history that git holds):\n" + "\n".join(hits))


@pytest.mark.parametrize("text, caught", [
    ("as at 2c62b76 (git show)", True), ("see issue #12", True), ("Issue 7 says", True),
    ("cost 0.1-0.25 ms of host time", True), ("~10 us against ~35 us", True), ("on first use (0.5-2 s)", True),
    ("copying at 26.7 GB/s", True), ("12,548 tok/s", True), ("220 tok/s", True),
    ("1e-06 comes back as 9.99999997e-07", False), ("mask 0x7fffffff", False), ("float8_e4m3fn", False),
    ("issues at 16 a clock", False), ("the H200 has 132 SMs", False), ("227 * 1024 bytes", False),
])
def test_the_patterns(text, caught):
    assert any(rx.search(text) for _, rx in RULES) == caught
