"""Code blocks of README.md and docs/*.md, and the markers that classify them.

Every fenced block with a language other than ``text`` is code, and the line
right above its opening fence says what it is:

- ``<!-- snippet: NAME -->``: runs as written; a test runs it by ``NAME``
  (tests/docs/test_snippets.py, tests/vllm/test_vllm_docs.py);
- ``<!-- fragment: WHY -->``: not run by a test, and ``WHY`` says why (a
  placeholder to fill in, a GPU cluster, a long benchmark...).

A block without a language (or ``text``) is output or a diagram. Imports
the standard library only, so that tests/vllm can use it too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)")
MARKER = re.compile(r"^<!--\s*(snippet|fragment):\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    kind: str | None  # "snippet" | "fragment" | None (unmarked)
    label: str  # the snippet's name or the fragment's reason

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of ``path`` that are code (see the module doc)."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, language = m.group(1), m.group(2)
        end = i + 1
        while end < len(lines) and not lines[end].startswith(fence):
            end += 1
        if end == len(lines):
            raise AssertionError(f"{path}:{i + 1}: code fence never closed")
        if language and language != "text":
            marker = MARKER.match(lines[i - 1]) if i else None
            out.append(Block(path, i + 1, language, "\n".join(lines[i + 1:end]) + "\n",
                             marker.group(1) if marker else None,
                             marker.group(2) if marker else ""))
        i = end + 1
    return out


def all_blocks() -> list[Block]:
    return [b for path in documents() for b in blocks(path)]


def snippet(name: str) -> Block:
    found = [b for b in all_blocks() if b.kind == "snippet" and b.label == name]
    if len(found) != 1:
        raise AssertionError(f"snippet {name!r}: expected exactly one in README.md/docs, found "
                             f"{[b.where for b in found]}")
    return found[0]
