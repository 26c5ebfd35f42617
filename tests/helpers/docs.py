"""What the documentation names: its files, the modules its commands run, its links and headings.

Read by ``tests/launch/test_entry_points_help.py`` (every module answers ``--help``) and
``tests/test_docs.py`` (every relative link resolves).
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers.distributed import REPO

DOC_FILES: tuple[Path, ...] = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))

# ``python -m X`` and ``torchrun ... -m X`` (also ``launch.netns ... -- -m X``); not ``-march``,
# not a placeholder such as ``launch.benchmarks.<name>``
_MODULE = re.compile(r"(?<![\w-])-m\s+([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?![\w.<])")
_FENCE = re.compile(r"^(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"`[^`]*`")
# [text](target) and ![alt](target), with an optional "title"
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def modules_named(text: str) -> set[str]:
    """Modules a command in ``text`` runs with ``-m``."""
    return set(_MODULE.findall(text))


def _outside_code_blocks(text: str) -> list[str]:
    """``text``'s lines outside fenced code blocks."""
    lines, is_code = [], False
    for line in text.splitlines():
        if _FENCE.match(line.lstrip()):
            is_code = not is_code
        elif not is_code:
            lines.append(line)
    return lines


def links(text: str) -> list[str]:
    """Targets of the markdown links and images in ``text``'s prose (not in code blocks or code
    spans; a code span or a link may wrap within its paragraph)."""
    paragraphs = "\n".join(_outside_code_blocks(text)).split("\n\n")
    return [m for par in paragraphs for m in _LINK.findall(_CODE_SPAN.sub("``", par))]


def heading_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (letters, digits, ``_``,
    ``-`` and spaces kept), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor; a repeated one gets ``-1``, ``-2``, … as on GitHub."""
    seen: dict[str, int] = {}
    result = set()
    for line in _outside_code_blocks(text):
        match = _HEADING.match(line)
        if not match:
            continue
        anchor = heading_anchor(match[2])
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        result.add(anchor if count == 0 else f"{anchor}-{count}")
    return result
