import numpy as np
import pytest

from luwu_rt import _C


def crc32c_reference(data: bytes, value: int = 0) -> int:
    # Bitwise definition of CRC-32C (reflected polynomial 0x82F63B78).
    crc = value ^ 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_standard_check_value() -> None:
    assert _C.crc32c(b"123456789") == 0xE3069283


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 1000, 4099])
def test_matches_reference_and_chains(n: int) -> None:
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    assert _C.crc32c(data) == crc32c_reference(data)
    cut = n // 3
    assert _C.crc32c(data[cut:], _C.crc32c(data[:cut])) == crc32c_reference(data)


def test_non_contiguous_is_refused() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        _C.crc32c(np.zeros(16, dtype=np.uint8)[::2])


@pytest.mark.parametrize("n", [3 * 256, 3 * 256 + 5, 3 * 8192, 3 * 8192 * 2 + 3 * 256 + 77, 200_003])
def test_three_stream_blocks_equal_one_stream(n: int) -> None:
    """Long buffers run three interleaved streams joined by shifts: equal to feeding 100-byte pieces (one
    stream each), and to the bitwise definition."""
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    chained = 0
    for i in range(0, n, 100):
        chained = _C.crc32c(data[i : i + 100], chained)
    assert _C.crc32c(data) == chained
    if n < 30_000:
        assert _C.crc32c(data) == crc32c_reference(data)
