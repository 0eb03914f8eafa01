"""`luwu ckpt`: list, verify and export checkpoints."""

from __future__ import annotations

import argparse

from luwu_rt.plan.dtypes import DTYPE_NAMES

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("list", "verify", "export"),
                        help="list: checkpoints under DIR; verify: check every checksum; export: write a state dict")
    parser.add_argument("path", help="checkpoint root (list) or a step_<N> directory (verify, export); "
                                     "a root means its latest checkpoint")
    parser.add_argument("--out", default=None,
                        help="export: output file (.safetensors, or anything else for torch.save)")
    parser.add_argument("--dtype", default="fp32", choices=tuple(DTYPE_NAMES), help="export: dtype (default fp32)")
    parser.add_argument("--format", default="file", choices=("file", "hf"),
                        help="export: file (a state dict in --out FILE) or hf (a Hugging Face model folder --out DIR "
                             "that from_pretrained loads; hf:PATH runs and GPT presets)")
    parser.add_argument("--max-shard-size", default="2GiB", help="export --format hf: largest shard (default 2GiB)")


def _resolve(path: str):
    from pathlib import Path

    from luwu_rt.ckpt.format import MANIFEST, latest_checkpoint

    p = Path(path)
    if (p / MANIFEST).exists():
        return p
    latest = latest_checkpoint(p)
    if latest is None:
        raise ValueError(f"{path} holds no complete checkpoint")
    return latest


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from luwu_rt.ckpt.format import NODE_SNAPSHOT, CheckpointReader, list_checkpoints
    from luwu_rt.kernels.dtypes import torch_dtype

    if args.action == "list":
        if not Path(args.path).is_dir():
            raise ValueError(f"{args.path} is not a directory; give a checkpoint root (--ckpt-dir of a run)")
        for path in list_checkpoints(args.path):
            try:
                reader = CheckpointReader(path, kind=None)
                what = "optimizer node snapshot" if reader.kind == NODE_SNAPSHOT else f"run {reader.run_id or '-'}"
                print(f"{path}  step {reader.step}  {what}")
            except (ValueError, OSError) as exc:  # list the others; say which one is broken
                print(f"{path}  unreadable: {exc}")
        return 0
    path = _resolve(args.path)
    if args.action == "verify":
        from luwu_rt.ckpt.save import verify_checkpoint

        if CheckpointReader(path, kind=None).kind == NODE_SNAPSHOT:  # the same format ([Note: node snapshots])
            from luwu_rt.node.snapshot import verify_snapshot

            snap = verify_snapshot(path)
            print(f"{path}: optimizer node snapshot of step {snap.step} (shard {snap.shard[0]}/{snap.shard[1]}), "
                  f"complete, all checksums match")
            return 0
        # Complete, consistent with its model, and every checksum (raises naming the path on a mismatch).
        reader = CheckpointReader(path)
        count = verify_checkpoint(reader, read_data=True)
        lacks = f"; being {reader.format}, it lacks {'; '.join(reader.lacks)}" if reader.lacks else ""
        print(f"{path}: {count} files, complete, all checksums match{lacks}")
        return 0
    if not args.out:
        raise ValueError("export needs --out FILE (e.g. model.safetensors), or --format hf --out DIR")
    dtype = torch_dtype(args.dtype, what="--dtype")
    if args.format == "hf":
        from luwu_rt.ckpt.export_hf import export_hf
        from luwu_rt.plan import parse_size

        try:
            shard = parse_size(args.max_shard_size)
        except ValueError as exc:
            raise ValueError(f"--max-shard-size {args.max_shard_size}: {exc}") from None
        print(export_hf(path, args.out, dtype=dtype, max_shard_bytes=shard))
        return 0
    from luwu_rt.ckpt.export import export

    print(export(path, args.out, dtype=dtype))
    return 0
