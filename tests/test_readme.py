"""Every example in README.md runs as written.

A fenced block whose info string carries ``run`` (```` ```bash run ````, ```` ```python run ````) is run: shell
blocks line by line with bash in one scratch directory, Python blocks as one script. Installing (``pip
install``, and a ``pip show`` that decides whether to) and the test suite itself are left out: they made the
environment these tests run in. Step counts are shortened to ``LUWU_README_STEPS`` per 100 written (default 2,
at least 1) by rewriting ``--steps N``, ``--stop-after N``, ``--schedule-steps N`` and ``range(N)`` (a ``luwu
train`` without ``--steps`` runs its 300 default steps, unless it resumes a run, which has its own), keeping
their proportions so that a resume still continues a shorter run.
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
DOC_PAGES = [README.parent / "docs" / "testing-swap-schedules.md"]
"""Pages whose every block runs, in order, in one scratch directory ([Note: doc pages that run])."""
STEPS = int(os.environ.get("LUWU_README_STEPS", "2"))
_FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```", re.S | re.M)


def _blocks(page: Path = README) -> list[tuple[str, str, str, int]]:
    """``(language, markers, body, line)`` of every fenced block."""
    text = page.read_text()
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
    # --stop-after and --schedule-steps count steps too: shortened alike, a stopped run still stops before its end.
    text = re.sub(r"--(steps|stop-after|schedule-steps) (\d+)", lambda m: f"--{m.group(1)} {_scaled(int(m.group(2)))}",
                  text)
    return re.sub(r"range\((\d+)\)", lambda m: f"range({_scaled(int(m.group(1)))})", text)


def _runnable(command: str) -> str:
    """``command`` without its install and test-suite parts; ``luwu train`` gets its shortened default steps."""
    parts = [p.strip() for p in command.split("&&")]
    # `{ pip show ... || pip install -e .; }` too: an install only where the package is missing.
    parts = [p for p in parts if not p.lstrip("{ ").startswith(("pip ", "python -m pytest"))]
    # A --resume takes the saved run's --steps.
    parts = [p + f" --steps {_scaled(300)}" if p.startswith("luwu train") and "--steps" not in p and "--resume" not in p
             else p for p in parts]
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


def _run_doc_block(page: Path, block: tuple[str, str, str, int], tmp_path: Path, index: int) -> None:
    """[Note: doc pages that run]
    A page that walks through building something (docs/testing-swap-schedules.md) runs as a reader follows
    it: every block in order, in one scratch directory, so that a later block imports what an earlier one
    wrote. ``python file=NAME`` writes NAME there (and imports it, so that it must at least load);
    ``python pytest`` is a test file, run with pytest, whose tests must all pass; ``python run`` and
    ``bash run`` run as in README."""
    lang, markers, body, line = block
    where = f"{page.name} line {line}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(README.parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("WORLD_SIZE", None)
    name = next((m.split("=", 1)[1] for m in markers.split() if m.startswith("file=")), None)
    if name is not None:
        (tmp_path / name).write_text(body)
        command = [sys.executable, "-c", f"import {Path(name).stem}"]
    elif "pytest" in markers.split():
        (tmp_path / f"test_doc_block_{index}.py").write_text(body)
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"test_doc_block_{index}.py"]
    elif lang == "python":
        (tmp_path / "example.py").write_text(body)
        command = [sys.executable, "example.py"]
    else:
        for line_command in _commands(body):
            run = subprocess.run(["bash", "-c", line_command], cwd=tmp_path, env=env, capture_output=True,
                                 text=True, timeout=600)
            assert run.returncode == 0, f"{where}: `{line_command}` failed:\n{run.stderr[-3000:]}"
        return
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{where}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    if "pytest" in markers.split():
        assert " passed" in run.stdout and "failed" not in run.stdout, f"{where}: {run.stdout[-2000:]}"


@pytest.mark.parametrize("page", DOC_PAGES, ids=[p.stem for p in DOC_PAGES])
def test_doc_page_runs_block_by_block(page, tmp_path):
    blocks = [b for b in _blocks(page) if b[0] in ("python", "bash")]
    unmarked = [line for _, markers, _, line in blocks
                if not {"run", "pytest"} & set(markers.split()) and "file=" not in markers]
    assert not unmarked, f"{page.name}: blocks at lines {unmarked} are neither run, pytest nor file=NAME"
    assert len(blocks) >= 5, f"{page.name} lost its examples"
    for index, block in enumerate(blocks):
        _run_doc_block(page, block, tmp_path, index)

