"""``luwu node serve``: an optimizer node for workers of ``luwu train --strategy node``."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bind", default="tcp://127.0.0.1:5555",
                        help="ZeroMQ address to listen on (default tcp://127.0.0.1:5555; a port of * lets the system "
                             "pick one, see --ready-file); any address but loopback needs --auth-keys")
    parser.add_argument("--num-workers", type=int, required=True, metavar="N",
                        help="workers that train with this node (the --nproc of luwu train)")
    parser.add_argument("--host-mem", default="1GiB", help="host memory for the node's states (default 1GiB)")
    parser.add_argument("--nvme-dir", default=None, help="directory for states that do not fit in --host-mem")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds to wait for a worker's gradients before stopping and naming it (default 300)")
    parser.add_argument("--auth-keys", default=None, metavar="DIR",
                        help="CURVE: accept only clients whose keys are in DIR/clients (luwu node keygen DIR)")
    parser.add_argument("--snapshot-dir", default=None, metavar="DIR",
                        help="write snapshots of the node's state here (a directory that survives restarts); a node "
                             "started on a DIR holding one resumes from it and the workers replay from its step")
    parser.add_argument("--snapshot-every", type=int, default=0, metavar="K",
                        help="snapshot after every K-th step (default 0: never; needs --snapshot-dir)")
    parser.add_argument("--resume-step", type=int, default=None, metavar="S",
                        help="resume from the snapshot of step S in --snapshot-dir rather than the newest (a node "
                             "shard does this itself when another shard restarted at step S)")
    parser.add_argument("--shard", default="0/1", metavar="I/K",
                        help="this process is node shard I of K (default 0/1): it keeps 1/K of every unit; start K "
                             "of them and give the workers all K addresses in shard order (--node A0,A1,...)")
    parser.add_argument("--ready-file", default=None, metavar="FILE",
                        help="write the bound address here once listening (for launchers)")
    parser.add_argument("--log-file", default=None, metavar="FILE",
                        help="append every line of the node here too, with its time; the per-step lines go only "
                             "here, not to stderr")
    parser.add_argument("--quiet", action="store_true",
                        help="no per-step lines on stderr (only into --log-file, if given); errors, refusals and the "
                             "start and end lines still go to stderr")


def _logs(log_file: str | None, *, quiet: bool):
    """The node's ``log`` (stderr, and ``log_file``) and ``step_log`` (``log_file`` if given, else stderr
    unless ``quiet``): per-step lines stay out of a terminal that shows the workers' progress bar."""
    import sys
    import time

    stream = None
    if log_file:
        try:
            stream = open(log_file, "a", buffering=1)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot open --log-file ({exc.strerror})", log_file) from None

    def to_file(line: str) -> None:
        if stream is not None:
            stream.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")

    def log(line: str) -> None:
        print(f"luwu node: {line}", file=sys.stderr, flush=True)
        to_file(line)

    def step_log(line: str) -> None:
        if stream is not None:
            to_file(line)
        elif not quiet:
            print(f"luwu node: {line}", file=sys.stderr, flush=True)

    return log, step_log


def run(args: argparse.Namespace) -> int:
    import threading
    from pathlib import Path

    from luwu_rt.interrupt import die_with_launcher
    from luwu_rt.node.service import NodeConfig, NodeService

    die_with_launcher()  # a node that luwu train --spawn-node started ends with it, even after a SIGKILL
    config = NodeConfig(bind=args.bind, num_workers=args.num_workers, host_mem=args.host_mem,
                        nvme_dir=args.nvme_dir, timeout=args.timeout, auth_keys=args.auth_keys,
                        snapshot_dir=args.snapshot_dir, snapshot_every=args.snapshot_every, shard=args.shard,
                        resume_step=args.resume_step)
    log, step_log = _logs(args.log_file, quiet=args.quiet)
    if args.log_file:
        log(f"per-step lines go to {args.log_file}")
    elif args.quiet:
        log("per-step lines are off (--quiet): --log-file FILE keeps them (under luwu train --spawn-node: "
            "--node-log FILE)")
    service = NodeService(config, log=log, step_log=step_log, restart=_restart_hook())
    ready = threading.Event()
    if args.ready_file:
        def announce() -> None:
            ready.wait()
            tmp = Path(args.ready_file + ".tmp")
            tmp.write_text(service.address)
            tmp.replace(args.ready_file)  # whole or absent: a launcher never reads half an address

        threading.Thread(target=announce, daemon=True).start()
    return service.serve(ready=ready)


def _restart_hook():
    """How this process starts anew on a snapshot ([Note: node shards that restart] in node/worker.py): it
    replaces itself (``exec``) with the same command, at the address it is bound to (a port of ``*`` stays the
    one the workers know) and from the snapshot of the step asked for. The kernel, not this process, ends its
    threads, sockets and in-flight IO, as when a node is killed and started again. None when the command line
    is not ``luwu node serve`` (the node runs inside another program, which restarts it itself)."""
    import os
    import sys

    argv = sys.argv[1:]
    if argv[:2] != ["node", "serve"]:
        return None

    def restart(step: int, address: str) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        # argparse takes an option's last value: these override the ones given first.
        os.execv(sys.executable, [sys.executable, "-m", "luwu_rt", *argv, "--bind", address,
                                  "--resume-step", str(step)])

    return restart
