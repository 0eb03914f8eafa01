"""Text and JSONL data through a tokenizer, cached beside the source ([Note: the token cache])."""

import json

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers", reason="tokenizers comes with the test extra")

from luwu_rt.data import DataConfig, load_tokens  # noqa: E402

DOCS = ["the cat sat on the mat", "a dog ran in the park", "the bird flew over the house"] * 20


def _tokenizer(folder):
    """A word-level tokenizer trained on DOCS (nothing downloaded), saved as tokenizer.json in ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(DOCS, trainers.WordLevelTrainer(special_tokens=["<unk>", "<|endoftext|>"]))
    folder.mkdir(exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return tok


def _jsonl(path, field="text"):
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    return path


def test_jsonl_is_tokenized_once_and_cached(tmp_path) -> None:
    tok = _tokenizer(tmp_path / "tok")
    data = _jsonl(tmp_path / "docs.jsonl")
    config = DataConfig(path=str(data), tokenizer=str(tmp_path / "tok"))
    first = load_tokens(config, vocab_size=64)
    eot = tok.token_to_id("<|endoftext|>")
    expected = [i for d in DOCS for i in tok.encode(d).ids + [eot]]
    assert np.concatenate([first.train, first.val]).tolist() == expected
    (cache,) = tmp_path.glob("docs.jsonl.*.uint16.tokens")
    stamp = cache.stat().st_mtime_ns
    again = load_tokens(config, vocab_size=64)
    assert cache.stat().st_mtime_ns == stamp and np.array_equal(again.train, first.train)


def test_a_model_folder_tokenizes_text_by_default(tmp_path) -> None:
    tok = _tokenizer(tmp_path / "model")
    text = tmp_path / "notes.txt"
    text.write_text("\n".join(DOCS))
    tokens = load_tokens(DataConfig(path=str(text)), vocab_size=64, default_tokenizer=tmp_path / "model")
    ids = np.concatenate([tokens.train, tokens.val]).tolist()
    assert ids[-1] == tok.token_to_id("<|endoftext|>") and max(ids) < tok.get_vocab_size()


@pytest.mark.parametrize("case", ["no tokenizer", "wrong field", "vocab too small"])
def test_bad_tokenized_input_is_one_clear_error(tmp_path, case) -> None:
    _tokenizer(tmp_path / "tok")
    data = _jsonl(tmp_path / "docs.jsonl", field="body")
    tokenizer, vocab, message = str(tmp_path / "tok"), 64, r"docs.jsonl:1: not a JSON object with a string field 'text'"
    if case == "no tokenizer":
        tokenizer, message = None, "is JSONL and needs --tokenizer"
    elif case == "vocab too small":
        vocab, message = 4, r"has \d+ ids but the model embeds 4"
    with pytest.raises(ValueError, match=message):
        load_tokens(DataConfig(path=str(data), tokenizer=tokenizer), vocab_size=vocab)
