"""Token streams for training: the default corpus, a text file, or a nanoGPT ``.bin``.

``--data PATH`` accepts

* a text file: byte-level tokens (vocabulary 256), like the default corpus;
* a ``.bin`` file: pre-tokenised ids as a flat little-endian uint16 or uint32
  array (nanoGPT's format), memory-mapped, never read whole;
* a directory holding nanoGPT's ``train.bin`` and ``val.bin``;
* with a tokenizer (``--tokenizer``, or an ``hf:PATH`` model's own), a text
  file or a ``.jsonl`` file (documents in ``--text-field``), tokenised once
  into a cached token file beside it ([Note: the token cache] in tokenize.py).

A single source is split deterministically: the last ``val_fraction`` of the
tokens is the validation set, the rest is the training set.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from luwu_rt.config import flag
from luwu_rt.data.corpus import DEFAULT_CORPUS_BYTES, stdlib_corpus

__all__ = ["BYTE_VOCAB_SIZE", "TOKEN_DTYPES", "DataConfig", "TokenData", "load_tokens", "max_token"]

BYTE_VOCAB_SIZE = 256
TOKEN_DTYPES = ("uint16", "uint32")

# Token ids are scanned for out-of-range values in slices of this many, so a
# multi-GB memmap is checked without being loaded at once.
_SCAN_TOKENS = 1 << 24
# At load time only this much of a .bin file is scanned, for an early, clear
# error; the batch sampler checks every batch it draws, so nothing unchecked
# ever reaches the embedding.
_LOAD_SCAN_BYTES = 256 * 2**20


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where training tokens come from."""

    path: str | None = field(default=None, metadata=flag(
        "text or JSONL file, nanoGPT .bin token file, or directory with train.bin and val.bin (default: the "
        "Python standard library's source)", name="--data", metavar="PATH"))
    """Text file, nanoGPT ``.bin`` file or directory with ``train.bin``/``val.bin``; ``None`` for the
    embedded standard-library corpus."""
    token_dtype: str | None = field(default=None, metadata=flag(
        "token dtype of a .bin file (default: uint16 if the vocabulary fits, else uint32)", name="--data-dtype",
        choices=TOKEN_DTYPES))
    """``uint16`` or ``uint32`` for a ``.bin`` file; ``None`` picks uint16 when the vocabulary fits in it."""
    val_fraction: float = 0.1
    """Share of a single source held out (from its end) for validation."""
    max_corpus_bytes: int = DEFAULT_CORPUS_BYTES
    """How much standard-library source the default corpus reads."""
    tokenizer: str | None = field(default=None, metadata=flag(
        "tokenizer.json or a model folder that tokenizes a text or JSONL --data once into a cached token file "
        "beside it (default: an hf:PATH model's own tokenizer; else byte-level text)", metavar="PATH"))
    """``tokenizer.json`` or a folder holding one, for a text or JSONL ``path``; ``None``: the ``hf:PATH``
    model's own tokenizer if its folder has one, else byte-level text (JSONL needs a tokenizer)."""
    text_field: str = field(default="text", metadata=flag("the field of each JSONL line that holds a document"))
    """The field of each JSONL line that holds a document."""

    def __post_init__(self) -> None:
        if self.token_dtype is not None and self.token_dtype not in TOKEN_DTYPES:
            raise ValueError(f"token dtype must be one of {', '.join(TOKEN_DTYPES)}, not {self.token_dtype!r}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), not {self.val_fraction}")
        if self.max_corpus_bytes <= 0:
            raise ValueError(f"max_corpus_bytes must be positive, not {self.max_corpus_bytes}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenData:
    """Training and validation token ids (numpy arrays or read-only memmaps)."""

    train: np.ndarray
    """Training tokens, 1-D."""
    val: np.ndarray
    """Validation tokens, 1-D."""
    vocab_size: int
    """Every id is below this."""
    source: str
    """Where the tokens came from, for logs."""


def load_tokens(config: DataConfig | None = None, *, vocab_size: int,
                default_tokenizer: str | os.PathLike | None = None) -> TokenData:
    """Open the configured source for a model with ``vocab_size`` token ids; ``default_tokenizer`` (a model
    folder) tokenises text when ``config.tokenizer`` is not given and it holds a ``tokenizer.json``."""
    config = config or DataConfig()
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, not {vocab_size}")
    if config.path is None:
        _require_byte_vocab(vocab_size, "the default corpus")
        tokens = np.frombuffer(stdlib_corpus(max_bytes=config.max_corpus_bytes), dtype=np.uint8)
        return _split(tokens, config, vocab_size=vocab_size, source="python stdlib source")
    path = Path(config.path)
    if path.is_dir():
        train = _open_bin(path / "train.bin", config, vocab_size)
        val = _open_bin(path / "val.bin", config, vocab_size)
        return TokenData(train=train, val=val, vocab_size=vocab_size, source=str(path))
    if path.suffix == ".bin":
        tokens = _open_bin(path, config, vocab_size)
        return _split(tokens, config, vocab_size=vocab_size, source=str(path))
    tokenizer = config.tokenizer
    if tokenizer is None and default_tokenizer is not None and (Path(default_tokenizer) / "tokenizer.json").is_file():
        tokenizer = default_tokenizer
    if tokenizer is not None or path.suffix == ".jsonl":
        if tokenizer is None:
            raise ValueError(f"--data {path} is JSONL and needs --tokenizer (a tokenizer.json or a model folder)")
        if not path.is_file():
            raise FileNotFoundError(errno.ENOENT, "data file not found (check --data)", str(path))
        from luwu_rt.data.tokenize import tokenized

        tokens = tokenized(path, tokenizer_path=tokenizer, text_field=config.text_field, vocab_size=vocab_size)
        return _split(tokens, config, vocab_size=vocab_size, source=f"{path} (tokenized with {tokenizer})")
    if config.token_dtype is not None:
        raise ValueError(f"--data-dtype applies to .bin token files; {str(path)!r} is read as byte-level text")
    _require_byte_vocab(vocab_size, f"text file {str(path)!r}")
    tokens = _memmap(path, np.uint8)
    return _split(tokens, config, vocab_size=vocab_size, source=str(path))


def max_token(tokens: np.ndarray, *, limit: int | None = None) -> int:
    """The largest id among the first ``limit`` tokens (all by default), scanned in slices."""
    end = len(tokens) if limit is None else min(limit, len(tokens))
    best = 0
    for start in range(0, end, _SCAN_TOKENS):
        best = max(best, int(tokens[start:min(end, start + _SCAN_TOKENS)].max()))
    return best


def _require_byte_vocab(vocab_size: int, what: str) -> None:
    if vocab_size < BYTE_VOCAB_SIZE:
        raise ValueError(f"{what} is byte-level and needs a vocabulary of at least {BYTE_VOCAB_SIZE}, but the "
                         f"model has {vocab_size}; choose a byte-level preset such as gpt-tiny")


def _memmap(path: Path, dtype: np.dtype) -> np.ndarray:
    if not path.exists():
        raise FileNotFoundError(errno.ENOENT, "data file not found (check --data)", str(path))
    if not path.is_file():
        raise OSError(errno.EINVAL, "data path is not a regular file (check --data)", str(path))
    size = path.stat().st_size
    itemsize = np.dtype(dtype).itemsize
    if size == 0:
        raise ValueError(f"data file {str(path)!r} is empty")
    if size % itemsize:
        raise ValueError(f"data file {str(path)!r} has {size} bytes, not a whole number of {np.dtype(dtype).name} "
                         f"tokens ({itemsize} bytes each); pass the right --data-dtype")
    return np.memmap(path, dtype=dtype, mode="r")


def _open_bin(path: Path, config: DataConfig, vocab_size: int) -> np.ndarray:
    dtype_name = config.token_dtype or ("uint16" if vocab_size <= 2**16 else "uint32")
    if dtype_name == "uint16" and vocab_size > 2**16:
        raise ValueError(f"a vocabulary of {vocab_size} does not fit uint16 tokens; use --data-dtype uint32")
    tokens = _memmap(path, np.dtype(dtype_name).newbyteorder("<"))
    scanned = _LOAD_SCAN_BYTES // tokens.itemsize
    top = max_token(tokens, limit=scanned)
    if top >= vocab_size:
        raise ValueError(f"data file {str(path)!r} holds token id {top}, but the model's vocabulary has "
                         f"{vocab_size} ids; use a model with a larger vocabulary or the right --data-dtype")
    return tokens


def _split(tokens: np.ndarray, config: DataConfig, *, vocab_size: int, source: str) -> TokenData:
    num_val = int(len(tokens) * config.val_fraction)
    if num_val < 2 or len(tokens) - num_val < 2:
        raise ValueError(f"{source} has only {len(tokens)} tokens, too few to split into training and "
                         "validation sets")
    cut = len(tokens) - num_val
    return TokenData(train=tokens[:cut], val=tokens[cut:], vocab_size=vocab_size, source=source)
