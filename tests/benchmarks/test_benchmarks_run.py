"""Every script under benchmarks/ runs on a tiny setting and prints its report.

The benchmarks run by hand, rarely, for minutes on a quiet machine: one that a change broke would be found
broken only then. So each script runs here as a user runs it (``python benchmarks/X.py ...``, a subprocess),
on a tiny model and a few MiB, on the CPU, with every output and scratch directory under ``tmp_path``, and
must exit 0 and print its report: the tables and ratio lines that carry its figures. No time is asserted (a
tiny run's figures mean nothing). A peer that is not installed (DeepSpeed, fio) must be reported as
unavailable, not crash the script.

The scripts are found by a glob, so a new script fails ``test_every_script_has_a_tiny_setting`` until it has
a tiny setting in ``_runs`` (and flags to make one, where it lacks them).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py"))
HELPERS = {"report.py": "what every report shares (machine, printing and saving the markdown)"}
"""Modules the scripts import that are not scripts themselves: no command line, nothing to run."""
TIMEOUT_S = 300


@dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    """One tiny invocation of a script and what its report must show."""

    args: list[str]
    """The command line after ``python benchmarks/<script>``."""
    expect: list[str]
    """Regular expressions each found in the standard output (the report, or its ratio lines)."""
    out: str | None = None
    """The results file it writes (``--out``)."""
    saved: list[str] | None = None
    """Regular expressions each found in ``out`` (default: ``expect``, where the file is the printed report)."""


def _runs(script: str, tmp: Path) -> list[Run]:
    """The tiny settings of each script: seconds each on 2 shared cores, a few MiB, the CPU only."""
    deepspeed = r"(\d|unavailable: deepspeed not usable)"  # a figure when installed, else the reason
    runs = {
        "bench_optim.py": [Run(args=["--numel", str(1 << 18), "--rounds", "1", "--out", f"{tmp}/optim.md"],
                               out=f"{tmp}/optim.md",
                               expect=[r"### P1: fp32 AdamW", r"\| cpp / probe \| \d", rf"\| deepspeed \| {deepspeed}",
                                       r"\| cpp / deepspeed \| (\d|deepspeed unavailable)",
                                       r"\| cpp / torch-fused \| \d", r"### P2: bf16 grads"])],
        "bench_io.py": [Run(args=["--dir", str(tmp), "--size-mb", "4", "--rounds", "1", "--out", f"{tmp}/io.md"],
                            out=f"{tmp}/io.md",
                            expect=[r"(\| ours-io_uring \| \d|io_uring unavailable here)", r"\| ours-threads \| \d",
                                    r"## P3 verdict\n\n- ",
                                    r"(deepspeed \S+ aio_handle|DeepSpeed async IO unavailable)",
                                    r"(fio-\d|fio not installed: no fio figures)"])],
        "bench_offload_step.py": [Run(args=["--nvme-dir", f"{tmp}/nvme", "--params", "4M", "--unit-params", "1M",
                                            "--host-mem", "64MiB", "--rounds", "1", "--out", f"{tmp}/offload.md"],
                                      out=f"{tmp}/offload.md",
                                      expect=[r"P4: step / IO bound = \d+\.\d+x \(median of 1 rounds"],
                                      saved=[r"\| 1 \| 4000000 \| \d", r"\*\*P4: \d+\.\d+x the IO lower bound\*\*"])],
        "unitwise_step.py": [Run(args=["--model", "gpt-tiny", "--batch-size", "1", "--seq-len", "16", "--repeats", "1",
                                       "--out", f"{tmp}/unitwise.md"], out=f"{tmp}/unitwise.md",
                                 expect=[r"\| plain autograd \| \d",
                                         r"\| unit-wise, recompute all \| .* \| \d+\.\d+x \|"])],
        "bench_node.py": [
            Run(args=["--mib", "4", "--chunk", "1MiB", "--repeats", "1", "--out", f"{tmp}/node.md"],
                out=f"{tmp}/node.md", expect=[r"\| plain \| 4 MiB \| 1MiB \| \d+\.\d+ \| \d+\.\d+ \| \d+\.\d+x \|"]),
            Run(args=["--mib", "4", "--chunk", "1MiB", "--repeats", "1", "--curve"],
                expect=[r"\| CURVE \| 4 MiB \| 1MiB \| \d+\.\d+ \| \d+\.\d+ \| \d+\.\d+x \|"]),
            Run(args=["--train", "--steps", "3", "--batch", "1", "--seq", "16", "--out", f"{tmp}/node-train.md"],
                out=f"{tmp}/node-train.md", expect=[r"zero3 \d+ ms \| node \d+ ms \| node/zero3 \d+\.\d+ \|"]),
        ],
        "bench_node_predict.py": [Run(args=["--steps", "3", "--batch", "1", "--seq", "16", "--net-mib", "4",
                                            "--optim-numel", str(1 << 16), "--out", f"{tmp}/node-predict.md"],
                                      out=f"{tmp}/node-predict.md",
                                      expect=[r"profile measured here: compute_flops=",
                                              r"\| measured \d+\.\d ms .* \| predicted \d+\.\d ms \([+-]\d+%\)"])],
        "bench_executor.py": [Run(args=["--units", "8", "--unit-params", "1024", "--rounds", "2",
                                        "--out", f"{tmp}/ex.md"],
                                  out=f"{tmp}/ex.md",
                                  expect=[r"\| overlap \| \d+\.\d+ \| [\d,]+ \| -?\d+\.\d \|",
                                          r"overlap / direct: \d+\.\d+x"])],
        "bench_dist.py": [Run(args=["--model", "gpt-tiny", "--batch-size", "1", "--seq-len", "16", "--rounds", "1",
                                    "--steps", "1", "--warmup", "1", "--calib-mib", "1", "--idle-s", "0.1",
                                    "--host-mem", "64MiB", "--device-mem", "64MiB", "--dev-device-mem", "128MiB",
                                    "--memory-steps", "1", "--memory-contestants", "ddp", "zero3",
                                    "--timeout", "120", "--out", f"{tmp}/dist.md"],
                              out=f"{tmp}/dist.md",
                              expect=[r"\| ddp \| torch-ddp \| \d+\.\d+x \|", r"\| zero3 \| fsdp2 \| (\d|n/a)",
                                      r"### Peak host memory per rank", r"\| zero3 \| .* \| \d+\.\d+x \|\n",
                                      r"P9 verdicts: ours ddp / torch DDP = \d"])],
        "bench_e2e.py": [Run(args=["--model", "gpt-tiny", "--batch-size", "1", "--seq-len", "16", "--steps", "2",
                                   "--rounds", "1", "--device-mem", "64MiB", "--host-mem", "64MiB", "--peers", "plain",
                                   "fsdp2", "ds-zero-offload", "--profile", "builtin", "--timeout", "240", "--out",
                                   f"{tmp}/e2e.md", "--json-out", f"{tmp}/e2e.json"],
                             out=f"{tmp}/e2e.md",
                             expect=[r"\| ours local device \| 1 \| [\d,]+ \|", r"\| plain \| 1 \| [\d,]+ \|",
                                     r"\| fsdp2 \| (2 \| [\d,]+|\| unavailable: )",
                                     r"\| ds-zero-offload \| (2 \| [\d,]+|\| unavailable: )",
                                     r"\| ours zero3 host \| ds-zero-offload \| (\d+\.\d+x|n/a: )",
                                     r"\| gpt-tiny zero3 x2 nvme clip 1x16 \| [\d,]+ \| .* \| [+-]\d+\.\d% \|"])],
        "bench_rss.py": [Run(args=["--model", "gpt-tiny", "--batch-size", "1", "--seq-len", "16", "--steps", "2",
                                   "--strategy", "zero3", "--nproc", "2", "--placement", "host", "--profile", "builtin",
                                   "--device-mem", "64MiB", "--host-mem", "64MiB", "--out", f"{tmp}/rss.md"],
                             out=f"{tmp}/rss.md",
                             expect=[r"\| engine built \(plan, arenas, queues\) \| [\d,]+ / [\d,]+ \| [\d,]+ / [\d,]+",
                                     r"\| step 2 \| [\d,]+ / [\d,]+, [\d,]+ / [\d,]+ \|",
                                     r"Peak RSS \(VmHWM\) per rank: [\d,]+ MiB, [\d,]+ MiB",
                                     r"Rank 0's arenas: device spans [\d,]+ MiB, at most [\d,]+ MiB live"]),
                         Run(args=["--model", "gpt-tiny", "--batch-size", "1", "--seq-len", "16", "--steps", "1",
                                   "--peer", "plain", "--out", f"{tmp}/rss-plain.md"],
                             out=f"{tmp}/rss-plain.md",
                             expect=[r"\| model built \(on meta, then materialised\) \| [\d,]+ / [\d,]+ \|",
                                     r"\| step 1 \| [\d,]+ / [\d,]+, [\d,]+ / [\d,]+ \|"])],
        "bench_simulate.py": [Run(args=["--model", "gpt-tiny", "--world-size", "2", "--seq-len", "64", "--chunk-size",
                                        "64KiB", "--device-mem", "256MiB", "--host-mem", "64MiB", "--rounds", "1",
                                        "--sweep", "4", "--out", f"{tmp}/simulate.md"],
                                  out=f"{tmp}/simulate.md",
                                  expect=[r"\| simulate, 2 ranks \| \d+ \| \d+\.\d+ \| [\d,]+ \| [\d.e-]+ "
                                          r"\| \+0\.00% \|",
                                          r"\| simulate, 2 ranks, chaos \| \d+ \|",
                                          r"P12: all 2 ranks of the gpt-tiny plan simulated in \d+\.\d+ s",
                                          r"agreement with estimate: max \|sim - est\| / est = 0 \(1 rank\), 0 \(every "
                                          r"rank\) over 4 small plans"])],
        "bench_compress.py": [Run(args=["--model", "gpt-tiny", "--batch-size", "1", "--seq-len", "16", "--steps", "1",
                                        "--warmup", "1", "--rounds", "1", "--numel", "65536", "--codec-rounds", "1",
                                        "--codecs", "none,bf16,onebit", "--link-gbps", "0.05",
                                        "--out", f"{tmp}/compress.md"],
                                  out=f"{tmp}/compress.md",
                                  expect=[r"\| onebit \| \d+ \| \d+\.\d+ \| \d+\.\d+ \| \d+\.\d+x \| >= 0\.5x",
                                          r"\| ours-onebit \| \d+\.\d+ \| \d+\.\d kB \| \d+\.\d kB \|",
                                          r"\| torch-ddp-bf16 \| \d+\.\d+ \|",
                                          r"P13 verdict: onebit sends \d+\.\dx fewer bytes on the wire"]),
                              Run(args=["--part", "codecs", "--numel", "65536", "--codec-rounds", "1",
                                        "--codecs", "bf16,onebit", "--out", f"{tmp}/codecs.md"],
                                  out=f"{tmp}/codecs.md",
                                  expect=[r"\| bf16 \| \d+ \| 20\.00 \| [\d.]+ \| [\d.]+x \|"]),
                              Run(args=["--part", "quality", "--batch-size", "1", "--seq-len", "16", "--warmups", "0,2",
                                        "--quality-steps", "3", "--out", f"{tmp}/quality.md"],
                                  out=f"{tmp}/quality.md",
                                  expect=[r"\| none \| \d+\.\d+ \| \+0\.0% \| [\d.]+ MB \| 1\.0x \|",
                                          r"\| topk:0.01 after 2 \| \d+\.\d+ \| [-+]\d+\.\d% \|"])],
        "bench_speculate.py": [Run(args=["--steps", "3", "--batch-size", "2", "--seq-len", "16", "--warmup", "1",
                                         "--interleave", "2",
                                         "--nvme-dir", f"{tmp}/nvme", "--out", f"{tmp}/speculate.md"],
                                   out=f"{tmp}/speculate.md",
                                   expect=[r"\| 1 \| clip off \| in place \(no norm to wait for\) \| \d",
                                           r"\| 1 \| wait \| double-buffered \| [\d.]+ \| [\d.]+ "
                                           r"\| 0 \| 0 \| 0 \| 3 \|",  # every step waited
                                           r"\| 1 \| always \| double-buffered \| [\d.]+ \| [\d.]+ "
                                           r"\| \d \| \d \| 0 \| 0 \|",  # every step speculated
                                           r"\| adaptive \| \d+\.\d+x \| (\d+\.\d+x|n/a) \| \d+\.\d+x \|",
                                           r"always: \d redo\(s\) in 3 steps",
                                           r"Exactness: wait, adaptive and always gave the same loss at every one of "
                                           r"the 3 steps"]),
                               # The state in memory: nothing double-buffered, every clipping step waits, and why.
                               Run(args=["--steps", "3", "--batch-size", "2", "--seq-len", "16", "--warmup", "1",
                                         "--optimizer", "host", "--host-mem", "64MiB", "--nvme-dir", f"{tmp}/nvme"],
                                   expect=[r"\| 1 \| wait \| waits: the optimizer state is in host memory.* \| - \| - "
                                           r"\| - \| 3 \|",
                                           r"always: not double-buffered, every step waited",
                                           r"Exactness: wait, adaptive and always gave the same loss"])],
        "bench_train.py": [Run(args=["--part", "both", "--p5-model", "gpt-tiny", "--p5-batch-size", "1",
                                     "--p5-seq-len", "16", "--p5-rounds", "1", "--p5-steps", "1", "--p5-warmup", "1",
                                     "--p5-device-mem", "64MiB", "--p5-host-mem", "128MiB",
                                     "--p7-model", "gpt-tiny", "--p7-seq-len", "32", "--p7-host-mem", "8MiB",
                                     "--p7-device-arena", "4MiB", "--p7-steps", "1", "--nvme-dir", f"{tmp}/nvme",
                                     "--out", f"{tmp}/train.md"],
                               out=f"{tmp}/train.md",
                               expect=[r"\| ours-host \| \d", r"\| fsdp2-cpu-offload \| (\d|unavailable: )",
                                       r"P5 verdict: ours-host / plain = \d", r"optimizer=nvme",
                                       r"\| \d+\.\d\d / \d+\.\d\d \| [\d.]+ \|",  # executed NVMe bytes, their IO
                                       r"P7 verdict: steps complete .* = \d+\.\d+x"])],
    }
    return runs.get(script, [])


def _env(tmp: Path, *, gpu: bool = False) -> dict[str, str]:
    """The scripts import this checkout's luwu_rt, see no GPU (unless ``gpu``), and make their scratch
    directories (``tempfile``'s) under ``tmp``."""
    scratch = tmp / "tmp"
    scratch.mkdir(exist_ok=True)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "TMPDIR": str(scratch), **({} if gpu else {"CUDA_VISIBLE_DEVICES": ""})}


def _run(script: str, args: list[str], tmp: Path, *, gpu: bool = False) -> str:
    """Runs ``python benchmarks/<script> ARGS`` in ``tmp``; its standard output, after checking it exited 0."""
    cmd = [sys.executable, str(BENCHMARKS / script), *args]
    try:
        done = subprocess.run(cmd, cwd=tmp, env=_env(tmp, gpu=gpu), capture_output=True, text=True,
                              timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{script} ran past {TIMEOUT_S}s on its tiny setting:\n{str(exc.stderr)[-3000:]}")
    assert done.returncode == 0, f"`{' '.join(cmd)}` exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done.stdout


def test_every_script_has_a_tiny_setting(tmp_path):
    scripts = [s for s in SCRIPTS if s not in HELPERS]
    missing = [s for s in scripts if not _runs(s, tmp_path)]
    assert not missing, (f"benchmarks/{', '.join(missing)} has no tiny setting: add one to _runs in {__file__} "
                         f"(and flags to make the script small, where it lacks them)")
    for helper in HELPERS:
        text = (BENCHMARKS / helper).read_text()
        assert "__main__" not in text, f"benchmarks/{helper} runs as a script now: give it a tiny setting"


def test_every_script_is_in_the_readme():
    """benchmarks/README.md holds the targets and the rules each script's docstring refers to, and its table
    says what each script measures, with its command."""
    readme = (BENCHMARKS / "README.md").read_text()
    for script in SCRIPTS:
        doc = ast.get_docstring(ast.parse((BENCHMARKS / script).read_text())) or ""
        assert script in HELPERS or "benchmarks/README.md" in doc, f"{script}'s docstring does not point to it"
        assert f"`{script}`" in readme, f"benchmarks/README.md does not list {script}"
        assert script in HELPERS or f"python benchmarks/{script}" in readme, f"README gives no command for {script}"


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s not in HELPERS])
def test_script_runs_tiny_and_reports(script, tmp_path):
    runs = _runs(script, tmp_path)
    assert runs, f"benchmarks/{script} has no tiny setting"
    for run in runs:
        stdout = _run(script, run.args, tmp_path)
        for pattern in run.expect:
            assert re.search(pattern, stdout), f"{script} {' '.join(run.args)}: no /{pattern}/ in\n{stdout[-3000:]}"
        if run.out:
            saved = Path(run.out).read_text()
            for pattern in run.saved or run.expect:
                assert re.search(pattern, saved), f"{script}: no /{pattern}/ in its results file {run.out}"


# bench_train's P7 defaults: the planning the engine does first, on the default model and budgets.
_PLAN_P7_DEFAULTS = """
import json
import sys
sys.path.insert(0, sys.argv[1])
from bench_train import p7_config, parse_args
from luwu_rt.engine.workload import config_model_spec
from luwu_rt.models.adapt import as_unit_chain
from luwu_rt.plan import Budgets, Placement, plan_auto
config = p7_config(parse_args(["--nvme-dir", sys.argv[2], *sys.argv[3:]]))
off = config.offload
spec = config_model_spec(as_unit_chain(config.model), config)
budgets = Budgets(device_bytes=off.device_mem_bytes, host_bytes=off.host_mem_bytes, nvme_bytes=1 << 40)
result = plan_auto(spec, budgets=budgets,
                   placement=Placement(params=off.params, optimizer=off.optimizer, grads=off.grads))
print(json.dumps({"model": config.model, "device_mem": off.device_mem_bytes, "activations": spec.activation_bytes,
                  "placement": str(result.placement)}))
"""


def test_bench_train_p7_defaults_plan(tmp_path):
    """``bench_train.py --part p7`` with its defaults (gpt-1.3b, 4 GiB host budget, state through NVMe) plans:
    its device budget holds the activations the engine reserves, measured, not a fixed figure that an
    activation reserve larger than it made unplannable (issue 21, item 6). Planned only: the run itself
    writes ~20 GB and takes minutes."""
    done = subprocess.run([sys.executable, "-c", _PLAN_P7_DEFAULTS, str(BENCHMARKS), str(tmp_path / "nvme")],
                          cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=TIMEOUT_S,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    planned = json.loads(done.stdout)
    assert planned["model"] == "gpt-1.3b", planned
    assert planned["device_mem"] == planned["activations"] + 2 * 2**30, f"the reserve + the 2 GiB arena: {planned}"
    assert "nvme" in planned["placement"], f"P7's state goes through NVMe: {planned}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="P8 measures GPU kernels: needs a CUDA device")
def test_bench_optim_cuda_runs_tiny_and_reports(tmp_path):
    stdout = _run("bench_optim.py", ["--device", "cuda", "--numel", str(1 << 20), "--rounds", "1"], tmp_path, gpu=True)
    for pattern in (r"### P8: fp32 AdamW on the GPU", r"\| cupy / probe \| (\d|cupy unavailable)",
                    r"### P8, low precision"):
        assert re.search(pattern, stdout), f"no /{pattern}/ in\n{stdout[-3000:]}"
