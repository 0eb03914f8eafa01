"""Every example in README.md runs as written.

A fenced block whose info string carries ``run`` (```` ```bash run ````, ```` ```python run ````) is run: shell
blocks line by line with bash in one scratch directory, Python blocks as one script. Installing (``pip
install``, and a ``pip show`` that decides whether to) and the test suite itself are left out: they made the
environment these tests run in. Step counts are shortened to ``LUWU_README_STEPS`` per 100 written (default 2,
at least 1) by rewriting ``--steps N`` and ``range(N)`` (a ``luwu train`` without ``--steps`` runs its 300
default steps), keeping their proportions so that a resume still continues a shorter run.
Blocks that need what CI lacks say so in the info string (```` ```bash needs-gpu ````, ``needs-cluster``,
``needs-disk``, ``needs-model``) and are only parsed: their shell lines must name real ``luwu`` commands and
flags (``--help`` accepts them), their Python must compile.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
STEPS = int(os.environ.get("LUWU_README_STEPS", "2"))
_FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```", re.S | re.M)


def _blocks() -> list[tuple[str, str, str, int]]:
    """``(language, markers, body, line)`` of every fenced block."""
    text = README.read_text()
    return [(m.group(1), m.group(2).strip(), m.group(3), text[: m.start()].count("\n") + 1)
            for m in _FENCE.finditer(text)]


def _commands(body: str) -> list[str]:
    """Shell commands of a block: comments dropped, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", body)
    return [line.split(" #")[0].strip() for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def _scaled(steps: int) -> int:
    return max(1, round(steps * STEPS / 100))


def _shorten(text: str) -> str:
    text = re.sub(r"--steps (\d+)", lambda m: f"--steps {_scaled(int(m.group(1)))}", text)
    return re.sub(r"range\((\d+)\)", lambda m: f"range({_scaled(int(m.group(1)))})", text)


def _runnable(command: str) -> str:
    """``command`` without its install and test-suite parts; ``luwu train`` gets its shortened default steps."""
    parts = [p.strip() for p in command.split("&&")]
    # `{ pip show ... || pip install -e .; }` too: an install only where the package is missing.
    parts = [p for p in parts if not p.lstrip("{ ").startswith(("pip ", "python -m pytest"))]
    parts = [p + f" --steps {_scaled(300)}" if p.startswith("luwu train") and "--steps" not in p else p for p in parts]
    return " && ".join(parts)


RUNNABLE = [b for b in _blocks() if "run" in b[1].split()]
PARSED = [b for b in _blocks() if any(m.startswith("needs-") for m in b[1].split())]


def test_readme_marks_its_examples():
    assert len(RUNNABLE) >= 4, "README's examples are marked runnable"
    unmarked = [line for lang, markers, _, line in _blocks() if lang in ("bash", "python") and not markers]
    assert not unmarked, f"README blocks at lines {unmarked} say neither 'run' nor what they need ('needs-...')"


@pytest.mark.parametrize("block", RUNNABLE, ids=[f"line{b[3]}" for b in RUNNABLE])
def test_runnable_block_runs_as_written(block, tmp_path):
    lang, _, body, line = block
    env = dict(os.environ, LUWU_README_STEPS=str(STEPS))
    env.pop("WORLD_SIZE", None)
    if lang == "python":
        script = tmp_path / "example.py"
        script.write_text(_shorten(body))
        run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=600)
        assert run.returncode == 0, f"README line {line}:\n{run.stderr[-3000:]}"
        return
    for command in map(_runnable, _commands(_shorten(body))):
        if not command:
            continue
        run = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=600)
        assert run.returncode == 0, f"README line {line}: `{command}` failed:\n{run.stderr[-3000:]}"


@pytest.mark.parametrize("block", PARSED, ids=[f"line{b[3]}" for b in PARSED])
def test_other_blocks_name_real_commands_and_flags(block):
    lang, _, body, line = block
    if lang == "python":
        compile(body, f"README.md:{line}", "exec")
        return
    for command in _commands(body):
        words = shlex.split(command)
        if words[0] == "torchrun":  # torchrun's own flags, then the module and its arguments
            words = ["luwu"] + words[words.index("luwu_rt") + 1:]
        if words[0] != "luwu":
            continue
        sub = [w for w in words[1:3] if not w.startswith("-")]
        flags = [w.split("=")[0] for w in words if w.startswith("--")]
        help_text = subprocess.run([sys.executable, "-m", "luwu_rt", *sub, "--help"], capture_output=True,
                                   text=True, timeout=120).stdout
        missing = [f for f in flags if f not in help_text]
        assert not missing, f"README line {line}: `{command}` uses flags that `luwu {' '.join(sub)}` lacks: {missing}"


def test_ci_runs_the_quickstarts_second_command_as_written():
    """.ci/run installs and tests a fresh environment with README's command 2 itself, so that the command a
    newcomer copies is the one CI proves."""
    quickstart = next(body for lang, markers, body, _ in RUNNABLE if "pip install" in body)
    second = [c for c in _commands(quickstart) if "pytest" in c]
    assert len(second) == 1, quickstart
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    assert second[0] in ci, f".ci/run does not run README's command 2 as written: {second[0]}"
