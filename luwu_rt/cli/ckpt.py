"""`luwu ckpt`: list, verify and export checkpoints."""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("list", "verify", "export"),
                        help="list: checkpoints under DIR; verify: check every checksum; export: write a state dict")
    parser.add_argument("path", help="checkpoint root (list) or a step_<N> directory (verify, export); "
                                     "a root means its latest checkpoint")
    parser.add_argument("--out", default=None, help="export: output file (.safetensors, or anything else for torch.save)")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"), help="export: dtype (default fp32)")


def _resolve(path: str):
    from pathlib import Path

    from luwu_rt.engine.checkpoint import MANIFEST, latest_checkpoint

    p = Path(path)
    if (p / MANIFEST).exists():
        return p
    latest = latest_checkpoint(p)
    if latest is None:
        raise ValueError(f"{path} holds no complete checkpoint")
    return latest


def run(args: argparse.Namespace) -> int:
    import torch

    from luwu_rt.engine.checkpoint import CheckpointReader, list_checkpoints

    if args.action == "list":
        for path in list_checkpoints(args.path):
            print(f"{path}  step {CheckpointReader(path).step}")
        return 0
    path = _resolve(args.path)
    if args.action == "verify":
        reader = CheckpointReader(path)
        for name in reader.tensors:
            reader.read(name)  # raises OSError naming the file on a mismatch
        print(f"{path}: {len(reader.tensors)} files, all checksums match")
        return 0
    if not args.out:
        raise ValueError("export needs --out FILE (e.g. model.safetensors)")
    from luwu_rt.engine.export import export

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    print(export(path, args.out, dtype=dtype))
    return 0
