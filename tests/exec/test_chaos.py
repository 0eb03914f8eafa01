"""The chaos mode's switch and its delays (luwu_rt/exec/chaos.py)."""

import importlib.util
import os
import subprocess
import sys

import pytest

from luwu_rt.exec.chaos import CHAOS_ENV, MAX_DELAY_S, Chaos


def _draws(chaos: Chaos, queue: str, n: int = 8) -> list[float]:
    delays = chaos.queue(queue)
    return [delays.next_delay_s() for _ in range(n)]


@pytest.mark.parametrize("value", [None, "", "  "])
def test_unset_or_empty_means_no_chaos(monkeypatch, value) -> None:
    if value is None:
        monkeypatch.delenv(CHAOS_ENV, raising=False)
    else:
        monkeypatch.setenv(CHAOS_ENV, value)
    assert Chaos.from_env() is None


def test_a_non_integer_seed_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setenv(CHAOS_ENV, "lots")
    with pytest.raises(ValueError, match=f"{CHAOS_ENV} must be an integer.*'lots'"):
        Chaos.from_env()


def test_rank_from_the_argument_else_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(CHAOS_ENV, "7")
    monkeypatch.setenv("RANK", "3")
    assert Chaos.from_env() == Chaos(seed=7, rank=3)
    assert Chaos.from_env(rank=5) == Chaos(seed=7, rank=5)
    monkeypatch.delenv("RANK")
    assert Chaos.from_env() == Chaos(seed=7, rank=0)


def test_delays_are_bounded_and_differ_by_seed_rank_and_queue() -> None:
    base = _draws(Chaos(seed=1), "compute")
    assert all(0 <= d <= MAX_DELAY_S for d in base) and len(set(base)) == len(base)
    assert _draws(Chaos(seed=1), "compute") == base  # a generator per queue, restarted per executor
    for other in (_draws(Chaos(seed=2), "compute"), _draws(Chaos(seed=1, rank=1), "compute"),
                  _draws(Chaos(seed=1), "h2d")):
        assert other != base


def test_every_process_derives_the_same_delays_from_seed_and_rank() -> None:
    # chaos.py needs only the standard library: load it alone in a process with another hash seed.
    path = importlib.util.find_spec("luwu_rt.exec.chaos").origin
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('c', sys.argv[1]); "
            "m = importlib.util.module_from_spec(spec); sys.modules['c'] = m; spec.loader.exec_module(m); "
            "d = m.Chaos(seed=11, rank=2).queue('reduce'); print(repr([d.next_delay_s() for _ in range(8)]))")
    out = subprocess.run([sys.executable, "-c", code, path], env={**os.environ, "PYTHONHASHSEED": "4321"},
                         capture_output=True, text=True, check=True).stdout
    assert eval(out) == _draws(Chaos(seed=11, rank=2), "reduce")


def test_the_chaos_fixture_sets_and_clears_the_seed(chaos) -> None:
    assert Chaos.from_env() == Chaos(seed=chaos.seed)
    with chaos.off():
        assert Chaos.from_env() is None
    chaos.set(5)
    assert Chaos.from_env().seed == 5
