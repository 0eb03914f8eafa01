"""``luwu node keygen DIR``: CURVE keys for the optimizer node and its workers ([Note: node keys])."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="where the keys go (the node's --auth-keys)")
    parser.add_argument("--client", default="worker",
                        help="name of the client key pair to add to the allow-list (default worker)")


def run(args: argparse.Namespace) -> int:
    from luwu_rt.node.auth import keygen

    for path in keygen(args.dir, client=args.client):
        print(path)
    print(f"node: luwu node serve --auth-keys {args.dir} ...; workers: luwu train --node-key "
          f"{args.dir}/{args.client}.key_secret ... (with node.key beside it)")
    return 0
