"""The documentation stays navigable: links resolve, `§` references name real sections, docs/ holds
no files named by dates or ordinals, and the generated configuration page is current."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from vllm_rlt import config_docs

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SKIP_DIRS = {".git", ".venv", ".ci-venv", "node_modules", "build", "dist", ".pytest_cache"}
CODE_DIRS = ("vllm_rlt", "benchmarks", "tests", "tools")

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.M)
SECTION = r"§\s?(\d+(?:\.\d+)*)"
# a document named right before one or more sections: "architecture.md §7, §11",
# "[scheduler.md](scheduler.md) §2"
CITATION = re.compile(r"([\w./-]+\.md)[`)]?((?:\s*(?:,|and)?\s*" + SECTION + r")+)")
ORDINALS = [
    "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth",
    "tenth", "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth",
    "seventeenth", "eighteenth", "nineteenth", "twentieth",
]  # fmt: skip
BAD_NAME = re.compile(
    r"(?:^|[^a-z])(?:" + "|".join(ORDINALS) + r"|\d+(?:st|nd|rd|th)|sessions?)(?:[^a-z]|$)"
    r"|\d{4}-\d{2}-\d{2}|(?:^|\D)20\d{6}(?:\D|$)",
    re.I,
)
HISTORY = re.compile(
    r"\b(?:" + "|".join(ORDINALS) + r")\s+session\b|\bsession\s+\d+\b|\b20\d\d-[01]\d-[0-3]\d\b",
    re.I,
)


def _files(suffixes: tuple[str, ...], top: Path = ROOT) -> list[Path]:
    out = []
    for path in sorted(top.rglob("*")):
        rel = path.relative_to(ROOT)
        if rel.parts and rel.parts[0] in SKIP_DIRS or not path.is_file():
            continue
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts):
            continue
        if path.suffix in suffixes:
            out.append(path)
    return out


def markdown_files() -> list[Path]:
    return _files((".md",))


def code_files() -> list[Path]:
    """Python sources, except this file (its examples are deliberately wrong)."""
    here = Path(__file__).resolve()
    return [p for d in CODE_DIRS for p in _files((".py",), ROOT / d) if p.resolve() != here]


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _sections(md: Path) -> set[str]:
    """Section numbers of `md`'s headings: "## 3. The step" and "### 1.3 Architecture" give
    "3" and "1.3"."""
    found = set()
    for title in HEADING.findall(md.read_text(encoding="utf-8")):
        m = re.match(r"§?\s?(\d+(?:\.\d+)*)\.?(?:\s|$)", title)
        if m:
            found.add(m.group(1))
    return found


def _resolve(name: str, source: Path) -> Path | None:
    for base in (source.parent, ROOT):
        candidate = (base / name).resolve()
        if candidate.is_file():
            return candidate
    return None


def section_problems(path: Path) -> list[str]:
    """Every `§` in `path` must follow a document whose heading carries that number; in a
    Markdown file a bare `§n` means the file itself."""
    text = path.read_text(encoding="utf-8")
    problems, covered = [], set()
    for m in CITATION.finditer(text):
        target = _resolve(m.group(1), path)
        numbers = re.findall(SECTION, m.group(2))
        for s in re.finditer("§", m.group(0)):
            covered.add(m.start() + s.start())
        if target is None:
            problems.append(f"{_rel(path)}: {m.group(1)} does not exist")
            continue
        missing = [n for n in numbers if n not in _sections(target)]
        if missing:
            problems.append(f"{_rel(path)}: {m.group(1)} has no section {missing}")
    for m in re.finditer(SECTION, text):
        if m.start() in covered:
            continue
        if path.suffix != ".md":
            problems.append(f"{_rel(path)}: §{m.group(1)} names no document")
        elif m.group(1) not in _sections(path):
            problems.append(f"{_rel(path)}: no section §{m.group(1)} in this file")
    return problems


def test_relative_links_resolve():
    dead = []
    for md in markdown_files():
        text = re.sub(r"```.*?```", "", md.read_text(encoding="utf-8"), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
                continue
            path = target.split("#", 1)[0]
            if not (md.parent / path).exists():
                dead.append(f"{_rel(md)}: {target}")
    assert not dead, "dead relative links:\n" + "\n".join(dead)


def test_section_references_have_targets():
    problems = [p for f in markdown_files() + code_files() for p in section_problems(f)]
    assert not problems, "section references without a target:\n" + "\n".join(problems)


def test_section_checker_catches_bad_references(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "a.md").write_text("# A\n\n## 1. One\n\n### 1.2 Sub\n\nSee §1 and §3.\n")
    (tmp_path / "b.py").write_text("# a.md §1.2, §2 and a bare §4\n")
    assert section_problems(tmp_path / "a.md") == ["a.md: no section §3 in this file"]
    assert section_problems(tmp_path / "b.py") == [
        "b.py: a.md has no section ['2']",
        "b.py: §4 names no document",
    ]


def test_docs_are_not_named_by_dates_or_ordinals():
    bad = [
        _rel(p)
        for p in sorted(DOCS.rglob("*"))
        if any(BAD_NAME.search(part) for part in p.relative_to(DOCS).parts)
    ]
    assert not bad, "files or folders under docs/ named by a date or an ordinal:\n" + "\n".join(bad)


@pytest.mark.parametrize("name", ["eleventh-session", "rerun-2026-11-30", "run-20261130", "3rd"])
def test_bad_name_pattern(name):
    assert BAD_NAME.search(name)


@pytest.mark.parametrize("name", ["serial-arrival", "run1.json", "wcpb-matrix.md", "firstly"])
def test_good_name_pattern(name):
    assert not BAD_NAME.search(name)


def test_docs_tell_no_session_history():
    hits = []
    for md in markdown_files():
        for n, line in enumerate(md.read_text(encoding="utf-8").splitlines(), 1):
            if HISTORY.search(line):
                hits.append(f"{_rel(md)}:{n}: {line.strip()[:100]}")
    assert not hits, "measurement history told by session or date:\n" + "\n".join(hits)


def test_configuration_page_is_current():
    page = DOCS / "configuration.md"
    assert page.read_text(encoding="utf-8") == config_docs.render(), (
        "docs/configuration.md is out of date: python -m vllm_rlt.config_docs > "
        "docs/configuration.md"
    )
