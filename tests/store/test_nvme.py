import errno

import pytest
import torch

from luwu_rt.io import IOEngine, aligned_empty
from luwu_rt.store.arena import Arena
from luwu_rt.store.nvme import NvmeTier

CHUNK = 16 * 4096
REGIONS = {(0, "master"): 3 * CHUNK, (1, "master"): 2 * CHUNK + 4096, (1, "exp_avg"): CHUNK}


@pytest.fixture
def engine():
    with IOEngine(block_bytes=4096 * 4, queue_depth=8) as e:
        yield e


def _fill(nbytes: int, seed: int) -> torch.Tensor:
    buf = aligned_empty(nbytes)
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return buf


def _write_all(tier: NvmeTier) -> dict:
    written = {}
    for i, ((unit, state), nbytes) in enumerate(REGIONS.items()):
        data = _fill(nbytes, i)
        tier.wait(tier.submit_write(unit, state, first_chunk=0, buffer=data))
        written[(unit, state)] = data
    return written


def test_round_trip_by_chunk_ranges_and_resume(tmp_path, engine) -> None:
    tier = NvmeTier(tmp_path, regions=REGIONS, chunk_bytes=CHUNK, engine=engine)
    written = _write_all(tier)
    # Read the tail of unit 1's region (chunk 2 is the short last chunk) and chunk 1 of unit 0.
    tail = aligned_empty(4096)
    tier.wait(tier.submit_read(1, "master", first_chunk=2, buffer=tail))
    assert torch.equal(tail, written[(1, "master")][2 * CHUNK :])
    mid = aligned_empty(CHUNK)
    tier.wait(tier.submit_read(0, "master", first_chunk=1, buffer=mid))
    assert torch.equal(mid, written[(0, "master")][CHUNK : 2 * CHUNK])
    tier.flush()

    # A new tier over the same directory and layout adopts the checksums.
    again = NvmeTier(tmp_path, regions=REGIONS, chunk_bytes=CHUNK, engine=engine)
    whole = aligned_empty(REGIONS[(1, "exp_avg")])
    again.wait(again.submit_read(1, "exp_avg", first_chunk=0, buffer=whole))
    assert torch.equal(whole, written[(1, "exp_avg")])


def test_corrupt_chunk_names_file_and_chunk(tmp_path, engine) -> None:
    tier = NvmeTier(tmp_path, regions=REGIONS, chunk_bytes=CHUNK, engine=engine)
    _write_all(tier)
    tier.flush()
    path = tmp_path / "master.bin"
    with open(path, "r+b") as f:  # unit 0 chunk 2 starts at 2 * CHUNK
        f.seek(2 * CHUNK + 100)
        byte = f.read(1)
        f.seek(2 * CHUNK + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    engine.forget(path)
    buf = aligned_empty(3 * CHUNK)
    with pytest.raises(OSError, match=r"chunk 2 of unit 0 state 'master'") as info:
        tier.wait(tier.submit_read(0, "master", first_chunk=0, buffer=buf))
    assert info.value.errno == errno.EIO and info.value.filename == str(path)


def test_other_layout_in_directory_is_refused(tmp_path, engine) -> None:
    NvmeTier(tmp_path, regions=REGIONS, chunk_bytes=CHUNK, engine=engine).flush()
    with pytest.raises(ValueError, match="different model"):
        NvmeTier(tmp_path, regions={(0, "master"): CHUNK}, chunk_bytes=CHUNK, engine=engine)


def test_unwritable_directory(tmp_path, engine) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError, match="nvme-dir"):
        NvmeTier(blocker / "sub", regions=REGIONS, chunk_bytes=CHUNK, engine=engine)


def test_not_enough_disk_is_refused_before_any_io(tmp_path, engine) -> None:
    with pytest.raises(OSError, match="more bytes but only") as info:
        NvmeTier(tmp_path, regions={(0, "master"): 1 << 60}, chunk_bytes=CHUNK, engine=engine)
    assert info.value.errno == errno.ENOSPC
    assert not (tmp_path / "master.bin").exists()


def test_arena_views_and_budget_check() -> None:
    arena = Arena(3 * 4096, tier="host")
    v = arena.view(4096, 8192, torch.float32)
    v.fill_(1.5)
    assert v.numel() == 2048 and arena.view(0, 4096).sum() == 0
    assert arena.buffer.data_ptr() % 4096 == 0
    with pytest.raises(ValueError, match="host-mem"):
        Arena(1 << 60, tier="host")
