"""Text and JSONL files tokenised once, through the ``tokenizers`` library, into a cached token file.

[Note: the token cache]
Tokenising a corpus takes minutes; sampling from it must not. The first run
writes the ids as a flat little-endian uint16 (uint32 above 65536 ids) array
beside the source, ``<name>.<key>.<dtype>.tokens``, where the key hashes the
tokenizer file, the JSONL field and the source's size and modification time:
a changed source or another tokenizer gets a new file, never a stale one. The
file is written under a temporary name and renamed, so an interrupted run
leaves no half cache. Later runs memory-map it like a nanoGPT ``.bin``.

Documents (a JSONL line's field; a text file is one document) are joined with
the tokenizer's end-of-text token, so the model sees where one ends.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

__all__ = ["load_tokenizer", "tokenized"]

# The end-of-text token, when the tokenizer's folder does not name it (tokenizer_config.json's eos_token).
_EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
_BATCH_DOCS = 256
_TEXT_BLOCK_BYTES = 1 << 20


def load_tokenizer(path: str | os.PathLike):
    """``(tokenizer, eot_id, tokenizer_file)`` from a ``tokenizer.json`` or a model folder holding one."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("--tokenizer needs the tokenizers package: pip install tokenizers") from None
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"--tokenizer {path}: no tokenizer.json there; give a tokenizer.json file or a "
                                "model folder that holds one")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:
        raise ValueError(f"--tokenizer {file}: not a tokenizers file ({exc})") from None
    names = list(_EOT_CANDIDATES)
    config = file.with_name("tokenizer_config.json")
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if eos:
            names.insert(0, eos)
    for name in names:
        eot = tokenizer.token_to_id(name)
        if eot is not None:
            return tokenizer, eot, file
    raise ValueError(f"--tokenizer {file}: no end-of-text token ({', '.join(_EOT_CANDIDATES)}) to join documents "
                     "with; add eos_token to tokenizer_config.json beside it")


def tokenized(source: Path, *, tokenizer_path: str | os.PathLike, text_field: str, vocab_size: int) -> np.ndarray:
    """The ids of ``source`` (text or JSONL), from the cache or tokenised now ([Note: the token cache])."""
    tokenizer, eot, file = load_tokenizer(tokenizer_path)
    num_ids = tokenizer.get_vocab_size(with_added_tokens=True)
    if num_ids > vocab_size:
        raise ValueError(f"--tokenizer {file} has {num_ids} ids but the model embeds {vocab_size}; use the "
                         "model's own tokenizer")
    dtype = np.dtype("<u2") if num_ids <= 1 << 16 else np.dtype("<u4")
    stat = source.stat()
    key = hashlib.sha256(file.read_bytes() + repr((text_field, stat.st_size, stat.st_mtime_ns)).encode()).hexdigest()
    cache = source.with_name(f"{source.name}.{key[:12]}.{dtype.name}.tokens")
    if not cache.exists():
        _write_cache(source, cache, tokenizer=tokenizer, eot=eot, text_field=text_field, dtype=dtype)
    if cache.stat().st_size == 0:
        raise ValueError(f"{source} holds no text to train on (field {text_field!r} of each JSONL line)")
    return np.memmap(cache, dtype=dtype, mode="r")


def _write_cache(source: Path, cache: Path, *, tokenizer, eot: int, text_field: str, dtype: np.dtype) -> None:
    from tqdm import tqdm

    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as out, tqdm(total=source.stat().st_size, unit="B", unit_scale=True,
                                          desc=f"tokenizing {source.name}") as bar:
            for docs, nbytes, ends in _documents(source, text_field):
                # ``ends``: the batch's documents end here (a text file's blocks but the last do not).
                ids = [e.ids + [eot] * ends for e in tokenizer.encode_batch(docs)]
                out.write(np.fromiter((i for doc in ids for i in doc), dtype=dtype).tobytes())
                bar.update(nbytes)
        os.replace(tmp, cache)
    except PermissionError as exc:
        raise OSError(exc.errno, f"cannot write the token cache beside the data (copy {source.name} to a "
                                 "writable folder)", str(tmp)) from None
    finally:
        tmp.unlink(missing_ok=True)


def _documents(source: Path, text_field: str) -> Iterator[tuple[list[str], int, bool]]:
    """Batches of documents, the source bytes they came from, and whether they end there."""
    if source.suffix == ".jsonl":
        yield from _jsonl(source, text_field)
        return
    # A text file is one document, tokenised in blocks cut at line ends; the end-of-text token comes once, last.
    with open(source, "rb") as f:
        pending = b""
        while block := f.read(_TEXT_BLOCK_BYTES):
            pending += block
            cut = pending.rfind(b"\n") + 1 or len(pending)
            piece, pending = pending[:cut], pending[cut:]
            yield [piece.decode("utf-8", errors="replace")], len(piece), False
        yield [pending.decode("utf-8", errors="replace")], len(pending), True


def _jsonl(source: Path, text_field: str) -> Iterator[tuple[list[str], int, bool]]:
    docs, nbytes = [], 0
    with open(source, "rb") as f:
        for number, line in enumerate(f, start=1):
            nbytes += len(line)
            if not line.strip():
                continue
            try:
                text = json.loads(line)[text_field]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{source}:{number}: not a JSON object with a string field {text_field!r}; name "
                                 "the field with --text-field") from None
            if not isinstance(text, str):
                raise ValueError(f"{source}:{number}: field {text_field!r} is {type(text).__name__}, not text")
            docs.append(text)
            if len(docs) == _BATCH_DOCS:
                yield docs, nbytes, True
                docs, nbytes = [], 0
    if docs:
        yield docs, nbytes, True
