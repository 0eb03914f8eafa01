import numpy as np
import pytest

from luwu_rt.data.tokens import DataConfig, load_tokens, max_token


def test_default_corpus_split_is_deterministic_and_disjoint() -> None:
    config = DataConfig(max_corpus_bytes=100_000)
    a = load_tokens(config, vocab_size=256)
    b = load_tokens(config, vocab_size=256)
    assert a.train.dtype == np.uint8
    assert len(a.train) == 90_000 and len(a.val) == 10_000
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    assert "stdlib" in a.source


def test_text_file_is_byte_level(tmp_path) -> None:
    path = tmp_path / "story.txt"
    text = "héllo wörld\n" * 100
    path.write_text(text, encoding="utf-8")
    data = load_tokens(DataConfig(path=str(path), val_fraction=0.25), vocab_size=256)
    raw = text.encode()
    assert bytes(data.train) + bytes(data.val) == raw
    assert len(data.val) == len(raw) // 4


@pytest.mark.parametrize("dtype, vocab", [("uint16", 50304), ("uint32", 100_000)])
def test_nanogpt_bin_dtype_follows_vocab(tmp_path, dtype, vocab) -> None:
    ids = (np.arange(1000) * 97 % vocab).astype(dtype)
    path = tmp_path / "train.bin"
    ids.tofile(path)
    data = load_tokens(DataConfig(path=str(path)), vocab_size=vocab)
    assert isinstance(data.train.base, np.memmap) or isinstance(data.train, np.memmap)
    assert np.array_equal(np.concatenate([data.train, data.val]), ids)


def test_explicit_dtype_and_directory_layout(tmp_path) -> None:
    np.arange(100, dtype=np.uint32).tofile(tmp_path / "train.bin")
    np.arange(10, dtype=np.uint32).tofile(tmp_path / "val.bin")
    data = load_tokens(DataConfig(path=str(tmp_path), token_dtype="uint32"), vocab_size=256)
    assert len(data.train) == 100 and len(data.val) == 10 and data.train.dtype == np.uint32


def test_token_outside_vocab_is_rejected(tmp_path) -> None:
    path = tmp_path / "t.bin"
    np.array([1, 2, 300, 4] * 10, dtype=np.uint16).tofile(path)
    with pytest.raises(ValueError, match="token id 300.*256"):
        load_tokens(DataConfig(path=str(path)), vocab_size=256)


@pytest.mark.parametrize("content, match", [
    (b"", "empty"),
    (b"\x01\x00\x02", "whole number of uint16"),
])
def test_bad_bin_files(tmp_path, content, match) -> None:
    path = tmp_path / "t.bin"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        load_tokens(DataConfig(path=str(path)), vocab_size=256)


def test_missing_file_and_misused_flags(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="--data"):
        load_tokens(DataConfig(path=str(tmp_path / "nope.txt")), vocab_size=256)
    with pytest.raises(FileNotFoundError, match="val.bin"):
        np.arange(10, dtype=np.uint16).tofile(tmp_path / "train.bin")
        load_tokens(DataConfig(path=str(tmp_path)), vocab_size=256)
    text = tmp_path / "a.txt"
    text.write_text("x" * 100)
    with pytest.raises(ValueError, match="--data-dtype applies to .bin"):
        load_tokens(DataConfig(path=str(text), token_dtype="uint16"), vocab_size=256)
    with pytest.raises(ValueError, match="at least 256"):
        load_tokens(DataConfig(path=str(text)), vocab_size=100)
    with pytest.raises(ValueError, match="does not fit uint16"):
        load_tokens(DataConfig(path=str(tmp_path / "train.bin"), token_dtype="uint16"), vocab_size=70_000)
    with pytest.raises(ValueError, match="too few"):
        (tmp_path / "tiny.txt").write_text("ab")
        load_tokens(DataConfig(path=str(tmp_path / "tiny.txt")), vocab_size=256)


@pytest.mark.parametrize("kwargs, match", [
    ({"token_dtype": "int8"}, "token dtype"),
    ({"val_fraction": 1.0}, "val_fraction"),
    ({"max_corpus_bytes": 0}, "max_corpus_bytes"),
])
def test_config_validation(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        DataConfig(**kwargs)


def test_max_token_scans_in_slices(monkeypatch) -> None:
    import luwu_rt.data.tokens as tokens

    monkeypatch.setattr(tokens, "_SCAN_TOKENS", 7)
    ids = np.zeros(100, dtype=np.uint16)
    ids[93] = 42
    assert max_token(ids) == 42
    assert max_token(ids, limit=90) == 0
