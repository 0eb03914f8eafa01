"""``NodeConfig``: the settings of one optimizer node process (``luwu node serve`` flags)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from luwu_rt.plan.sizes import parse_size

from .protocol import MAX_PAYLOAD_BYTES
from .shards import parse_shard

__all__ = ["SPARE_CONNECTIONS", "NodeConfig", "check_address", "is_loopback"]

SPARE_CONNECTIONS = 4
"""Connections a node takes beyond its workers' and node shards': a worker that reconnects before the node
saw its old connection end ([Note: the connection cap] in auth.py)."""


@dataclass(kw_only=True, slots=True)
class NodeConfig:
    """An optimizer node process (``luwu node serve`` flags)."""

    bind: str = "tcp://127.0.0.1:5555"
    """ZeroMQ address the ROUTER binds; only loopback (``tcp://127.0.0.1``, ``ipc://``) until CURVE lands."""
    num_workers: int = 1
    """Workers that push to this node; every one must say HELLO before the first step."""
    host_mem: int | str = "1GiB"
    """Host memory for the node's states (master weights, moments, gradients, served parameters)."""
    nvme_dir: str | None = None
    """Directory for states that do not fit in ``host_mem`` (scratch: rebuilt at start)."""
    timeout: float = 300.0
    """Seconds the node waits for a worker's gradients before it stops and names the missing rank."""
    max_message_bytes: int | str = MAX_PAYLOAD_BYTES
    """Largest payload accepted (a message chunk is at most 16 MiB)."""
    io_backend: str = "auto"
    """IO engine backend of the NVMe tier."""
    auth_keys: str | None = None
    """Directory made by ``luwu node keygen``: CURVE with its allow-list of client keys ([Note: node keys]
    in auth.py); required to bind anything but loopback."""
    snapshot_dir: str | None = None
    """Directory for node snapshots ([Note: node snapshots] in snapshot.py); must survive restarts. A node
    started on one that holds a snapshot resumes from it."""
    snapshot_every: int = 0
    """Snapshot after every K-th step (0: never)."""
    resume_step: int | None = None
    """Resume from the snapshot of this step rather than the newest (``--resume-step``): what a node shard does
    when it goes back to the step another shard restarted at ([Note: node shards that restart] in worker.py)."""
    shard: str = "0/1"
    """``i/k``: this process is node shard i of k, owning 1/k of every unit ([Note: node shards] in shards.py)."""
    shard_index: int = field(init=False, default=0)
    num_shards: int = field(init=False, default=1)

    @property
    def max_connections(self) -> int:
        """Connections the node takes at once ([Note: the connection cap] in auth.py)."""
        return self.num_workers + self.num_shards - 1 + SPARE_CONNECTIONS

    def __post_init__(self) -> None:
        self.shard_index, self.num_shards = parse_shard(self.shard)
        if not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise ValueError(f"--num-workers must be a positive integer, got {self.num_workers!r}")
        self.host_mem = parse_size(self.host_mem)
        self.max_message_bytes = parse_size(self.max_message_bytes)
        if not 0 < self.max_message_bytes <= MAX_PAYLOAD_BYTES:
            raise ValueError(f"max_message_bytes must be in (0, {MAX_PAYLOAD_BYTES}], got {self.max_message_bytes}")
        if not self.timeout > 0:
            raise ValueError(f"--timeout must be a positive number of seconds, got {self.timeout!r}")
        if not isinstance(self.snapshot_every, int) or self.snapshot_every < 0:
            raise ValueError(f"--snapshot-every must be a whole number of steps >= 0, got {self.snapshot_every!r}")
        if self.snapshot_every and not self.snapshot_dir:
            raise ValueError("--snapshot-every needs --snapshot-dir DIR (a directory that survives restarts)")
        if self.resume_step is not None:
            if not isinstance(self.resume_step, int) or self.resume_step < 1:
                raise ValueError(f"--resume-step must be a step >= 1 that a snapshot holds, got {self.resume_step!r}")
            if not self.snapshot_dir:
                raise ValueError("--resume-step needs --snapshot-dir DIR, the directory holding that step's snapshot")
        check_address(self.bind, flag="--bind", bind=True)
        if not is_loopback(self.bind) and not self.auth_keys:
            raise ValueError(f"--bind {self.bind}: binding anything but loopback needs --auth-keys DIR (CURVE keys "
                             f"from `luwu node keygen DIR`), or bind tcp://127.0.0.1:PORT")


_TCP = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.\-]*|\*):(\*|[0-9]{1,5})")
_LOOPBACK = re.compile(r"(127\.[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}|localhost|\[::1\])")


def check_address(address: str, *, flag: str, bind: bool) -> None:
    """Raises ``ValueError`` naming ``flag`` unless ``address`` is one ZeroMQ endpoint: ``tcp://HOST:PORT``
    (one host, a port in 1..65535; a node may bind ``*`` for either), ``ipc://PATH`` or ``inproc://NAME``.
    ZeroMQ itself takes more: ``tcp://A;B:P`` (a source address) and a port past 65535, which it wraps
    around to another port without a word."""
    if address.startswith(("ipc://", "inproc://")) and address.split("://", 1)[1]:
        return
    match = _TCP.fullmatch(address)
    if match is None:
        raise ValueError(f"{flag} {address!r}: expected tcp://HOST:PORT (one host name or IP address), ipc://PATH "
                         f"or inproc://NAME")
    host, port = match.groups()
    if not bind and "*" in (host, port):
        raise ValueError(f"{flag} {address}: a worker connects to one host and port, not *")
    if port != "*" and not 0 < int(port) <= 65535:
        raise ValueError(f"{flag} {address}: port {int(port)} is not in 1..65535" + (" (or * for one the system "
                                                                                    "picks)" if bind else ""))


def is_loopback(address: str) -> bool:
    """Whether ``address`` (checked by ``check_address``) reaches this machine only."""
    if address.startswith(("ipc://", "inproc://")):
        return True
    match = _TCP.fullmatch(address)
    return match is not None and _LOOPBACK.fullmatch(match.group(1)) is not None
