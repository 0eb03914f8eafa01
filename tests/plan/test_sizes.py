import pytest

from luwu_rt.plan.sizes import format_size, parse_size


@pytest.mark.parametrize("text, expected", [
    ("4096", 4096), ("512MiB", 512 * 2**20), ("4GiB", 4 * 2**30), ("1.5TB", 1_500_000_000_000),
    ("2 gib", 2 * 2**30), ("10k", 10_000), ("64KiB", 65536), ("0", 0), (".5KiB", 512), (123, 123),
])
def test_parse_size(text, expected) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "4 GiBs", "-1GiB", "1e3", "4 parsecs"])
def test_parse_size_rejects_with_examples(text) -> None:
    with pytest.raises(ValueError, match="512MiB"):
        parse_size(text)


def test_parse_size_rejects_negative_int() -> None:
    with pytest.raises(ValueError, match="negative"):
        parse_size(-5)


def test_format_size_round_trips_binary_units() -> None:
    assert format_size(1536 * 2**20) == "1.5 GiB"
    assert format_size(100) == "100 B"
    assert parse_size(format_size(3 * 2**40).replace(" ", "")) == 3 * 2**40
