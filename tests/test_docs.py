"""README.md and docs/*.md stay honest: every relative link, image and ``#anchor`` resolves, the
README stays short and keeps the set-up and test commands CI relies on, and no measurement is
attributed to a work session instead of a machine and a date. (That every module they run answers
``--help`` is ``tests/launch/test_entry_points_help.py``.)"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.helpers.distributed import REPO
from tests.helpers.docs import DOC_FILES, anchors, heading_anchor, links, read

README_MAX_LINES = 250
SETUP_COMMAND = (
    'pip install -c constraints-cpu.txt -e ".[test]" && torchrun --standalone --nproc-per-node 2 '
    "-m launch.generate --data-parallel-size 2 --enable-expert-parallel --enable-dbo "
    "--max-tokens 32 --output out.jsonl"
)
TEST_BLOCK = "```bash\npython -m pytest -q\n```"  # .ci/run runs this command
SESSION_WORDING = re.compile(
    r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|this|that|previous|next|"
    r"later|earlier|each|every) sessions?\b",
    re.IGNORECASE,
)


def _id(path: Path) -> str:
    return str(path.relative_to(REPO))


def _broken_links(path: Path) -> list[str]:
    broken = []
    for target in links(read(path)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # https:, mailto:, …
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / unquote(file_part)).resolve() if file_part else path.resolve()
        if not resolved.is_relative_to(REPO) or not resolved.exists():
            broken.append(f"{target}: no file {resolved}")
        elif anchor and resolved.suffix == ".md" and unquote(anchor) not in anchors(read(resolved)):
            broken.append(f"{target}: no heading with anchor #{unquote(anchor)} in {resolved.name}")
    return broken


@pytest.mark.parametrize("path", DOC_FILES, ids=_id)
def test_every_relative_link_resolves(path):
    assert not _broken_links(path)


def test_docs_have_one_file_per_topic():
    names = {path.name for path in DOC_FILES}
    topics = {"dbo", "backends", "serving", "models", "benchmarks", "profiling", "hardware"}
    assert {f"{topic}.md" for topic in topics | {"development"}} <= names


def test_readme_is_short_and_keeps_the_commands_ci_runs():
    text = read(REPO / "README.md")
    assert len(text.splitlines()) <= README_MAX_LINES
    assert SETUP_COMMAND in text
    assert TEST_BLOCK in text
    assert "python3 -m pytest -q" in read(REPO / ".ci" / "run")


@pytest.mark.parametrize("path", DOC_FILES, ids=_id)
def test_measurements_name_machines_not_sessions(path):
    assert not SESSION_WORDING.findall(read(path))


def test_heading_anchors_follow_github():
    assert heading_anchor("Adaptive DBO (`auto` thresholds)") == "adaptive-dbo-auto-thresholds"
    assert (
        heading_anchor("DBO on the 100 µs / 0.28 Gbit/s link")
        == "dbo-on-the-100-µs--028-gbits-link"
    )
    assert heading_anchor("Offline throughput (`launch.bench_throughput`)") == (
        "offline-throughput-launchbench_throughput"
    )
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}
