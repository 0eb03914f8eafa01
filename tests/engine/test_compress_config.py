"""``--compress`` (issue 23, item 4): a field of TrainConfig and so a flag of ``luwu train`` and ``luwu plan`` from
the one flag table, checked where it is set, passed on by ``--nproc`` unchanged; under ``--strategy auto`` a
codec keeps only the strategies that can compress; the JSON log carries bytes on the wire and codec time."""

from __future__ import annotations

import argparse

import pytest

from luwu_rt.cli import plan, train
from luwu_rt.cli.flags import config_argv, config_overrides
from luwu_rt.config import from_mapping
from luwu_rt.engine import TrainConfig
from luwu_rt.engine.strategy import candidate_strategies


def _parse(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="luwu", allow_abbrev=False)
    module.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("module", [train, plan])
def test_compress_is_a_flag_of_train_and_plan(module) -> None:
    args = _parse(module, ["--compress", "topk:0.01", "--strategy", "zero1"])
    config = from_mapping(TrainConfig, config_overrides(args))
    assert config.compress == "topk:0.01"
    assert "--compress=topk:0.01" in config_argv(args)  # the ranks of --nproc get it
    assert TrainConfig().compress == "none"


@pytest.mark.parametrize("value,error", [("zip", "--compress 'zip': unknown codec"),
                                         ("topk:2", "0 < RATIO <= 1"), ("powersgd:x", "an integer >= 1")])
def test_a_bad_codec_is_refused_naming_the_flag(value, error) -> None:
    with pytest.raises(ValueError, match=error):
        TrainConfig(compress=value)


@pytest.mark.parametrize("strategy", ["zero3", "hsdp"])
def test_a_codec_for_a_strategy_that_cannot_compress_is_refused(strategy) -> None:
    with pytest.raises(ValueError, match=f"--compress onebit applies to --strategy ddp, zero1, zero2 .*not {strategy}"):
        TrainConfig(compress="onebit", strategy=strategy)
    TrainConfig(compress="auto", strategy=strategy)  # auto: nothing to choose there, not an error


def test_compress_warmup_is_a_train_flag_checked_where_it_is_set() -> None:
    """[Note: compression warm-up] in engine/engine.py: N uncompressed steps before the codec; refused without a
    codec to delay, for node (its workers push with one codec from the first step) and below 0, each by name."""
    config = from_mapping(TrainConfig, config_overrides(_parse(train, ["--compress", "topk:0.01",
                                                                       "--compress-warmup", "100"])))
    assert (config.compress, config.compress_warmup) == ("topk:0.01", 100) and TrainConfig().compress_warmup == 0
    TrainConfig(compress="auto", compress_warmup=5)
    with pytest.raises(ValueError, match="--compress-warmup 5 delays a codec that --compress does not name"):
        TrainConfig(compress_warmup=5)
    with pytest.raises(ValueError, match="--compress-warmup 5 applies to ddp, zero1 and zero2"):
        TrainConfig(compress="onebit", compress_warmup=5, strategy="node", node="tcp://127.0.0.1:1")
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="compress_warmup .--compress-warmup. must be an integer >= 0"):
            TrainConfig(compress="onebit", compress_warmup=bad)
    from luwu_rt.plan import Strategy

    strategy = Strategy(name="ddp", world_size=2, compress=("topk:0.01", "none", "topk:0.01"))
    assert train._compression(strategy, 100) == (", gradients compressed (topk:0.01 on 2 of 3 units) from step 101, "
                                                 "uncompressed before")  # luwu train's first line
    assert train._compression(strategy, 0) == ", gradients compressed (topk:0.01 on 2 of 3 units)"


def test_node_pushes_take_the_elementwise_codecs_and_refuse_the_others_by_name() -> None:
    """[Note: compressed pushes] in plan/codec.py: powersgd and auto are refused for node, naming what it takes."""
    node = {"strategy": "node", "node": "tcp://127.0.0.1:1"}
    for codec in ("bf16", "fp16", "onebit", "topk:0.01", "none"):
        TrainConfig(compress=codec, **node)
    with pytest.raises(ValueError, match="node pushes compress with bf16, fp16, onebit or topk:RATIO, not powersgd"):
        TrainConfig(compress="powersgd:2", **node)
    for auto in ("auto", "auto:bf16,onebit"):
        with pytest.raises(ValueError, match=f"--compress {auto} is not offered for --strategy node.*name one codec"):
            TrainConfig(compress=auto, **node)


def test_auto_strategy_with_a_codec_keeps_the_strategies_that_compress() -> None:
    def names(c: str) -> list[str]:
        return [s.name for s in candidate_strategies("auto", world_size=4, shard_group_size=2, compress=c)]

    assert names("onebit") == ["ddp", "zero1", "zero2"]
    assert names("auto") == names("none") == ["ddp", "zero1", "zero2", "zero3", "hsdp"]


def test_the_json_log_has_bytes_on_the_wire_and_codec_time() -> None:
    assert {"wire_bytes", "encode_s", "decode_s"} <= set(train._LOGGED)
