"""Issue 12, case 3: a checkpoint's manifest protects itself, and verify checks completeness.

Random edits of a real manifest (a value changed, an entry deleted, the file truncated) are refused
by ``verify`` and by ``--resume`` with the path; so are edits that recompute the manifest's checksum
but leave the checkpoint incomplete or inconsistent with its model.
"""

import json
import random
import shutil
from pathlib import Path

import pytest
from safety_common import SMALL, luwu, one_line_error

from luwu_rt.engine import Engine, TrainConfig
from luwu_rt.ckpt.format import MANIFEST, CheckpointReader, _manifest_crc
from luwu_rt.ckpt.save import verify_checkpoint


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real checkpoint (untrained weights are enough: the manifest is what is tested)."""
    root = tmp_path_factory.mktemp("ck")
    with Engine(None, TrainConfig(batch_size=2, seq_len=16, steps=4)) as engine:
        return engine.save(root)


def _leaves(node, path=()):
    """Every (path, value) in a JSON tree, containers included (so that they can be deleted)."""
    yield path, node
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        yield from _leaves(value, path + (key,))


def _edit(manifest: dict, rng: random.Random) -> dict | None:
    """A copy of ``manifest`` with one random field changed or deleted; None when the edit changed nothing."""
    out = json.loads(json.dumps(manifest))
    path, value = rng.choice([leaf for leaf in _leaves(out) if leaf[0]])
    parent = out
    for key in path[:-1]:
        parent = parent[key]
    if rng.random() < 0.3:
        del parent[path[-1]]
    elif isinstance(value, bool):
        parent[path[-1]] = not value
    elif isinstance(value, (int, float)):
        parent[path[-1]] = value + rng.choice([1, -1, 7])
    elif isinstance(value, str):
        parent[path[-1]] = rng.choice(["int32", value + "x", "", "float16"])
    elif isinstance(value, list):
        parent[path[-1]] = value + [1] if rng.random() < 0.5 else value[:-1]
    else:
        parent[path[-1]] = {}
    return None if out == manifest else out


def _refused(directory) -> bool:
    try:
        verify_checkpoint(CheckpointReader(directory), read_data=True)
    except (ValueError, OSError) as exc:
        assert str(directory) in str(exc), exc  # every refusal names the checkpoint or its file
        return True
    return False


def test_random_edits_and_truncations_are_refused(saved, tmp_path) -> None:
    original = json.loads((saved / MANIFEST).read_text())
    assert not _refused(saved)
    rng = random.Random(1212)
    tried = 0
    for trial in range(150):
        work = tmp_path / f"c{trial}"
        shutil.copytree(saved, work)
        if trial % 5 == 0:  # truncated at a random byte
            raw = (saved / MANIFEST).read_bytes()
            (work / MANIFEST).write_bytes(raw[: rng.randrange(len(raw))])
        else:
            edited = _edit(original, rng)
            if edited is None:
                continue
            (work / MANIFEST).write_text(json.dumps(edited, indent=1))
        tried += 1
        assert _refused(work), f"edit {trial} was accepted"
        shutil.rmtree(work)
    assert tried > 100


def _resigned(saved, tmp_path, change) -> Path:
    """A copy whose manifest ``change`` edits and whose checksum is recomputed (a consistent-looking lie)."""
    work = tmp_path / "resigned"
    shutil.copytree(saved, work)
    manifest = json.loads((work / MANIFEST).read_text())
    change(manifest)
    manifest["checksum"] = _manifest_crc(manifest)
    (work / MANIFEST).write_text(json.dumps(manifest))
    return work


def test_missing_entry_is_incomplete_even_with_a_valid_checksum(saved, tmp_path) -> None:
    work = _resigned(saved, tmp_path, lambda m: m["tensors"].pop("u1.exp_avg"))
    with pytest.raises(ValueError, match="u1.exp_avg.*incomplete"):
        verify_checkpoint(CheckpointReader(work), read_data=False)
    r = luwu("ckpt", "verify", str(work))
    one_line_error(r, str(work), "u1.exp_avg")


def test_dtype_changed_to_int32_is_refused(saved, tmp_path) -> None:
    work = _resigned(saved, tmp_path, lambda m: m["tensors"]["u0.master"].update(dtype="int32"))
    with pytest.raises(ValueError, match="u0.master is int32"):
        verify_checkpoint(CheckpointReader(work), read_data=False)


def test_edited_lr_is_refused_by_verify_and_resume(saved, tmp_path) -> None:
    root = tmp_path / "root"
    shutil.copytree(saved, root / saved.name)
    path = root / saved.name / MANIFEST
    path.write_text(path.read_text().replace('"lr": 0.003', '"lr": 30.0'))
    one_line_error(luwu("ckpt", "verify", str(root)), str(path), "checksum")
    one_line_error(luwu("train", "--steps", "6", *SMALL, "--ckpt-dir", str(root), "--resume"),
                   str(path), "checksum", "no usable checkpoint")


def _as_format_1(saved, tmp_path, change=lambda m: None, *, strip: bool = False) -> Path:
    """A copy whose manifest says format 1 without a checksum (after ``change``); ``strip`` also drops the
    fields format 1 did not have, as a real format 1 manifest is."""
    root = tmp_path / ("stripped" if strip else "downgraded")
    work = root / saved.name
    shutil.copytree(saved, work)
    manifest = json.loads((work / MANIFEST).read_text())
    change(manifest)
    manifest["format"] = "luwu_rt.checkpoint/1"
    del manifest["checksum"]
    if strip:
        del manifest["meta"]["run_id"]
        for entry in manifest["tensors"].values():
            del entry["bytes"]
    (work / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return work


def test_a_manifest_downgraded_to_format_1_is_refused(saved, tmp_path) -> None:
    """Issue 20, item 6: setting `format` to format 1 and deleting the checksum let an edited manifest (lr 0.5,
    two units' master files swapped) pass `luwu ckpt verify` and resume. It holds fields format 1 never had."""
    def edit(m: dict) -> None:
        m["meta"]["config"]["optim"]["lr"] = 0.5
        t = m["tensors"]  # two blocks of one shape: each file still matches the checksum its entry names
        assert t["u1.master"]["shape"] == t["u2.master"]["shape"]
        t["u1.master"], t["u2.master"] = t["u2.master"], t["u1.master"]

    work = _as_format_1(saved, tmp_path, edit)
    assert _refused(work)
    r = luwu("ckpt", "verify", str(work))
    one_line_error(r, str(work / MANIFEST), "meta.run_id", "the manifest was edited")
    r = luwu("train", "--steps", "1", *SMALL, "--ckpt-dir", str(work.parent), "--resume")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "resuming from" not in r.stderr, r.stderr


def test_a_format_1_checkpoint_is_read_and_says_what_it_lacks(saved, tmp_path) -> None:
    work = _as_format_1(saved, tmp_path, strip=True)
    reader = CheckpointReader(work)
    assert reader.format == "luwu_rt.checkpoint/1" and reader.run_id is None and reader.lacks
    r = luwu("ckpt", "verify", str(work))
    assert r.returncode == 0, r.stderr
    assert "all checksums match; being luwu_rt.checkpoint/1, it lacks a checksum of the manifest itself" in r.stdout
    r = luwu("train", "--steps", "1", *SMALL, "--ckpt-dir", str(work.parent), "--resume")
    assert r.returncode == 0, r.stderr
    assert f"{work} is a luwu_rt.checkpoint/1 checkpoint: it lacks a checksum of the manifest itself" in r.stderr
