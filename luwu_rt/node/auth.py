"""CURVE authentication of node traffic: keys made by ``luwu node keygen``, an allow-list of client keys.

[Note: node keys]
``luwu node keygen DIR`` writes, with pyzmq's ``zmq.auth`` certificate files:
  DIR/node.key, DIR/node.key_secret      the node's key pair
  DIR/clients/<name>.key                 the allow-list: public keys of clients the node accepts
  DIR/<name>.key_secret                  that client's key pair, given to workers with ``--node-key``
A worker's ``--node-key FILE`` names its ``.key_secret``; the node's public key is read from
``node.key`` in the same directory (copy both to the workers' machines). The node started with
``--auth-keys DIR`` runs a ZAP authenticator that admits only the keys in ``DIR/clients``: a client
with any other key never completes the handshake, so none of its messages reaches the node; the
failed handshakes are counted (``rejects["auth"]``). Every frame is then encrypted and authenticated.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["client_keys", "keygen", "server_keys"]

NODE = "node"


def keygen(directory: str | os.PathLike, *, client: str = "worker") -> list[Path]:
    """Creates the node's key pair (unless it exists) and a client key pair ``client``, its public key
    in the allow-list; returns the files written."""
    import zmq.auth

    root = Path(directory)
    (root / "clients").mkdir(parents=True, exist_ok=True)
    written = []
    if not (root / f"{NODE}.key_secret").exists():
        written += [Path(p) for p in zmq.auth.create_certificates(root, NODE)]
    if (root / f"{client}.key_secret").exists():
        raise ValueError(f"{root / (client + '.key_secret')} exists already: choose another --client name")
    public, secret = (Path(p) for p in zmq.auth.create_certificates(root, client))
    allowed = root / "clients" / public.name
    public.replace(allowed)
    os.chmod(secret, 0o600)
    os.chmod(root / f"{NODE}.key_secret", 0o600)
    return written + [allowed, secret]


def server_keys(directory: str | os.PathLike) -> tuple[bytes, bytes, Path]:
    """(public, secret, allow-list directory) of the node, from ``--auth-keys DIR``."""
    import zmq.auth

    root = Path(directory)
    path, clients = root / f"{NODE}.key_secret", root / "clients"
    if not path.is_file() or not clients.is_dir():
        raise ValueError(f"--auth-keys {root}: no {path.name} or clients/ there; make keys with "
                         f"`luwu node keygen {root}`")
    public, secret = zmq.auth.load_certificate(path)
    return public, secret, clients


def client_keys(path: str | os.PathLike) -> tuple[bytes, bytes, bytes]:
    """(public, secret, the node's public key) of a worker, from ``--node-key FILE``."""
    import zmq.auth

    path = Path(path)
    node = path.parent / f"{NODE}.key"
    if not path.is_file() or not node.is_file():
        raise ValueError(f"--node-key {path}: needs that .key_secret file and {node.name} beside it "
                         f"(made by `luwu node keygen`)")
    public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise ValueError(f"--node-key {path} holds no secret key: give the client's .key_secret file")
    return public, secret, zmq.auth.load_certificate(node)[0]
