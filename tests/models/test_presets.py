import pytest

from luwu_rt.models.presets import PRESETS, GPTShape, get_preset


@pytest.mark.parametrize("name", [n for n, p in PRESETS.items() if p.nominal_params])
def test_named_presets_within_two_percent_of_nominal(name: str) -> None:
    p = PRESETS[name]
    assert abs(p.num_params / p.nominal_params - 1) <= 0.02, (name, p.num_params)


def test_unknown_preset_lists_choices() -> None:
    with pytest.raises(ValueError, match="gpt-tiny"):
        get_preset("gpt-7")


def test_heads_must_divide_width() -> None:
    with pytest.raises(ValueError, match="num_heads"):
        GPTShape(name="bad", num_layers=1, d_model=100, num_heads=3, vocab_size=256, max_seq_len=8)
