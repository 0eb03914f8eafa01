"""``luwu node keygen DIR``: CURVE keys for the optimizer node and its workers ([Note: node keys])."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="where the keys go (the node's --auth-keys)")
    parser.add_argument("--client", default="worker",
                        help="name of the client key pair to add to the allow-list (default worker)")
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="one key pair per worker, NAME0 .. NAME<N-1> (NAME: --client): the allow-list names "
                             "each, and the node logs which key each rank joined with")


def run(args: argparse.Namespace) -> int:
    from luwu_rt.node.auth import keygen

    for path in keygen(args.dir, client=args.client, workers=args.workers):
        print(path)
    name = args.client if args.workers is None else f"{args.client}{{rank}}"
    print(f"node: luwu node serve --auth-keys {args.dir} ...; workers: luwu train --node-key "
          f"{args.dir}/{name}.key_secret ... (with node.key beside it"
          + ("; {rank} is each worker's rank)" if args.workers is not None else ")"))
    return 0
