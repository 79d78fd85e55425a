"""The engine digest that identifies the code a benchmark ran (`benchmarks/provenance.py`)."""

from __future__ import annotations

from benchmarks import provenance


def test_digest_follows_paths_and_contents_of_the_python_sources(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "PACKAGE", tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    (tmp_path / "notes.txt").write_text("not code")
    first = provenance.engine_digest()
    assert len(first) == 16 and first == provenance.engine_digest()
    (tmp_path / "notes.txt").write_text("changed")
    assert provenance.engine_digest() == first  # only Python sources count
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    changed = provenance.engine_digest()
    assert changed != first
    (tmp_path / "sub" / "b.py").rename(tmp_path / "b2.py")
    assert provenance.engine_digest() != changed  # a moved file is a different tree
