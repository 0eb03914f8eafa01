"""`luwu` entry point.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``. Modules import heavy dependencies inside ``run`` so that
``luwu --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import textwrap

# (command path, module, one-line help). A path of two words is a nested
# subcommand such as `luwu bench io`.
COMMANDS: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("train",), "luwu_rt.cli.train", "train a model larger than the device and host budgets (default: gpt-tiny)"),
    (("ckpt",), "luwu_rt.cli.ckpt", "list, verify and export checkpoints (safetensors or torch.save)"),
    (("plan",), "luwu_rt.cli.plan", "plan a training step: where each state lives, peak memory, IO and step time"),
    (("calibrate",), "luwu_rt.cli.calibrate", "measure this machine (disk, copies, optimizer, compute, network) into "
                                              "the hardware profile the planner predicts with"),
    (("plot",), "luwu_rt.cli.plot", "plot a run's --json-log: loss, tokens/s and where the step time went"),
    (("node", "serve"), "luwu_rt.cli.node", "run an optimizer node for luwu train --strategy node (over ZeroMQ)"),
    (("node", "keygen"), "luwu_rt.cli.node_keygen", "make CURVE keys for an optimizer node and its workers"),
    (("bench", "io"), "luwu_rt.cli.bench_io", "O_DIRECT write/read throughput of the IO engine on a directory"),
    (("bench", "offload-step"), "luwu_rt.cli.bench_offload",
     "one AdamW step with optimizer state on NVMe vs the IO bound"),
    (("bench", "e2e"), "luwu_rt.cli.bench_e2e", "training steps end to end per strategy and placement, beside the "
                                               "planner's predicted step"),
    (("bench", "optim"), "luwu_rt.cli.bench_optim", "optimizer step throughput: our backends vs peers vs memory"),
)

_GROUP_HELP = {"bench": "measure throughput of the runtime's parts against their peers",
               "node": "the optimizer node of strategy node: holds the optimizer, aggregates gradients"}


class _Help(argparse.HelpFormatter):
    """argparse's help, wrapped between words only: its default breaks a line inside a flag's name
    (`--profile-` / `out`), which a reader copying the flag then gets wrong."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def build_parser() -> argparse.ArgumentParser:
    from luwu_rt import __version__

    # allow_abbrev=False on every parser: a prefix of a flag is a typo, not the flag (`--step 5` is not --steps).
    common = {"allow_abbrev": False, "formatter_class": _Help}
    parser = argparse.ArgumentParser(prog="luwu", description="luwu_rt: train models larger than GPU memory.",
                                     **common)
    parser.add_argument("--version", action="version", version=f"luwu_rt {__version__}")
    top = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for path, module_name, help_text in COMMANDS:
        module = importlib.import_module(module_name)
        if len(path) == 1:
            sub = top.add_parser(path[0], help=help_text, description=help_text, **common)
        else:
            group, leaf = path
            if group not in groups:
                gp = top.add_parser(group, help=_GROUP_HELP.get(group, ""), **common)
                groups[group] = gp.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
            sub = groups[group].add_parser(leaf, help=help_text, description=help_text, **common)
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run, _parser=sub)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line parsed; a word that no parser knows is reported under the usage of the command it
    was given to (`luwu train --step 5`: train's usage), where argparse itself would report it under
    the top-level one."""
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    from luwu_rt import heap

    # Before torch or any thread of ours allocates: one heap for the process ([Note: the C heap under CPU tensors]).
    heap.share_one_arena()
    args = parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except BrokenPipeError:
        # The reader went away (`luwu plan | head`): not an error of ours; say nothing more to the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, OSError) as exc:
        # User-caused problems (bad sizes, missing directories, full disks) get
        # one clear line and a non-zero exit, not a traceback.
        print(f"luwu: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # a wait that a signal ended says which (luwu_rt.interrupt.Interrupted)
        print(f"luwu: {exc}" if str(exc) else "luwu: interrupted", file=sys.stderr)
        return getattr(exc, "exit_code", 130)


if __name__ == "__main__":
    sys.exit(main())
