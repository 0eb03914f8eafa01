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

[Note: refused handshakes]
A refused handshake is said on both sides when it happens, not found out later.
The node (``NodeGate``) logs each one: a key not in the allow-list with that
key (its Z85 public key, as the ``.key`` files hold it), a client without CURVE
as such; a peer that repeats them is summarised after 30 lines a minute. The
worker's client watches its DEALER's handshake events (``handshake_problem``)
and fails its wait at once with one line saying what to fix - the node
requires CURVE keys, does not allow this key, does not use CURVE, or is not
the node whose ``node.key`` the worker has - instead of waiting out
``--timeout`` in silence.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

__all__ = ["NodeGate", "client_keys", "handshake_problem", "keygen", "server_keys"]

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


class NodeGate:
    """The node's side of CURVE: CURVE on its ROUTER, a ZAP authenticator admitting the allow-list (and the
    node's own key: other node shards connect with it, [Note: node shards] in shards.py), and a monitor of
    the ROUTER's handshakes; each refusal counted and logged when it happens ([Note: refused handshakes])."""

    def __init__(self, ctx, router, auth_keys: str, *, rejects: Counter, log: Callable[[str], None]) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        public, secret, clients = server_keys(auth_keys)
        self.rejects = rejects
        self.log = _Throttled(log)
        self.authenticator = ThreadAuthenticator(ctx)
        self.authenticator.start()
        self.authenticator.configure_curve_callback(domain="*", credentials_provider=_Allowed(clients, public,
                                                                                            self.log))
        router.curve_server = True
        router.curve_publickey, router.curve_secretkey = public, secret
        self._router = router
        self._failed = _failed_events()
        self.monitor = router.get_monitor_socket(self._failed)
        """A socket the loop polls beside its ROUTER; ``on_monitor`` when it is readable."""

    def on_monitor(self) -> None:
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            if not event["event"] & self._failed:
                continue
            self.rejects["auth"] += 1
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                continue  # the authenticator logged it, with the key
            if event["value"] == getattr(zmq, "PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH", -1):
                self.log("refused a client without CURVE keys (a worker without --node-key?)")
            else:  # the client may have hung up first, having seen the mismatch itself: no detail then
                detail = (f"ZMTP error {event['value']:#x}" if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                          else f"errno {event['value']}")
                self.log(f"refused a client whose handshake failed ({detail}): a worker without --node-key, or "
                         f"with another node's node.key?")

    def close(self) -> None:
        self._router.disable_monitor()
        self.monitor.close(0)
        self.authenticator.stop()
        self.log.flush()


def _failed_events() -> int:
    import zmq

    return zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


class _Allowed:
    """ZAP credentials: the public keys in the allow-list directory, read at start, and the node's own."""

    def __init__(self, clients: Path, node_public: bytes, log: Callable[[str], None]) -> None:
        import zmq.auth

        self.clients, self.log = clients, log
        self.keys = set(zmq.auth.load_certificates(str(clients))) | {node_public}

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        self.log(f"refused a client key {key.decode(errors='replace')}: it is not in {self.clients}")
        return False


class _Throttled:
    """A log for refusals a peer can repeat at will: every one while they are few (30 a minute), then
    how many more there were ([Note: refused handshakes])."""

    LINES = 30
    WINDOW_S = 60.0

    def __init__(self, log: Callable[[str], None]) -> None:
        self.inner = log
        self._lock = threading.Lock()
        self._start, self._count, self._more = time.monotonic(), 0, 0

    def __call__(self, line: str) -> None:
        with self._lock:
            if time.monotonic() - self._start > self.WINDOW_S:
                self._flush()
            self._count += 1
            if self._count > self.LINES:
                self._more += 1
                return
        self.inner(line)

    def flush(self) -> None:
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        if self._more:
            self.inner(f"refused {self._more} more handshakes (not logged one by one) in the last "
                       f"{time.monotonic() - self._start:.0f}s")
        self._start, self._count, self._more = time.monotonic(), 0, 0


def handshake_problem(event: int, value: int, *, address: str, key: str | None, public: bytes | None) -> str | None:
    """What a worker's failed handshake with the node at ``address`` means, as one line with the fix, or
    None while it may be passing (a connection cut mid-handshake): ``key`` is the worker's ``--node-key``
    (``public`` its public key), None without CURVE ([Note: refused handshakes])."""
    import zmq

    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"the optimizer node at {address} does not allow this worker's key (--node-key {key}, public key "
                f"{(public or b'').decode(errors='replace')}): add it to the node's --auth-keys DIR/clients, or use "
                f"a key made there (luwu node keygen DIR --client NAME)")
    mismatch = event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == getattr(
        zmq, "PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH", -1)
    if mismatch and key is None:
        return (f"the optimizer node at {address} requires CURVE keys: pass --node-key DIR/NAME.key_secret (luwu "
                f"node keygen DIR)")
    if mismatch:
        return (f"the optimizer node at {address} does not use CURVE (it runs without --auth-keys): leave out "
                f"--node-key {key}")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return (f"the handshake with the optimizer node at {address} failed (ZMTP error {value:#x}): is a luwu node "
                f"serve of this version listening there?")
    if key is not None:  # the node hung up: it runs without CURVE, or with another key pair than node.key's
        return (f"the optimizer node at {address} ended the CURVE handshake: it runs without --auth-keys (then "
                f"leave out --node-key), or the node.key beside --node-key {key} is not its key")
    return None
