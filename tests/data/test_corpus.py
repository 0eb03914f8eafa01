import sysconfig

import pytest

from luwu_rt.data.corpus import stdlib_corpus, stdlib_source_files


def test_corpus_is_capped_and_deterministic() -> None:
    a = stdlib_corpus(max_bytes=200_000)
    b = stdlib_corpus(max_bytes=200_000)
    assert a == b and len(a) == 200_000
    assert stdlib_corpus(max_bytes=300_000)[:200_000] == a  # a longer cap extends, never reorders


def test_corpus_is_the_sorted_stdlib_source() -> None:
    files = stdlib_source_files()
    rel = [p.relative_to(sysconfig.get_paths()["stdlib"]).as_posix() for p in files]
    assert rel == sorted(rel)
    assert not any(part in ("site-packages", "dist-packages") for r in rel for part in r.split("/"))
    first = next(p for p in files if p.stat().st_size > 0).read_bytes()
    assert stdlib_corpus(max_bytes=len(first)) == first


def test_custom_root_and_errors(tmp_path) -> None:
    (tmp_path / "b.py").write_bytes(b"B")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "z.py").write_bytes(b"Z")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "x.py").write_bytes(b"X")
    (tmp_path / "notes.txt").write_bytes(b"T")
    assert stdlib_corpus(root=tmp_path) == b"Z\n\nB\n\n"
    with pytest.raises(ValueError, match="max_bytes"):
        stdlib_corpus(root=tmp_path, max_bytes=0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(OSError, match="no Python source"):
        stdlib_corpus(root=tmp_path / "empty")
    with pytest.raises(OSError, match="does not exist"):
        stdlib_corpus(root=tmp_path / "missing")
