"""``NodeConfig``: the settings of one optimizer node process (``luwu node serve`` flags)."""

from __future__ import annotations

from dataclasses import dataclass, field

from luwu_rt.plan.sizes import parse_size

from .protocol import MAX_PAYLOAD_BYTES
from .shards import parse_shard

__all__ = ["NodeConfig"]


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
    shard: str = "0/1"
    """``i/k``: this process is node shard i of k, owning 1/k of every unit ([Note: node shards] in shards.py)."""
    shard_index: int = field(init=False, default=0)
    num_shards: int = field(init=False, default=1)

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
        if not _is_loopback(self.bind) and not self.auth_keys:
            raise ValueError(f"--bind {self.bind}: binding anything but loopback needs --auth-keys DIR (CURVE keys "
                             f"from `luwu node keygen DIR`), or bind tcp://127.0.0.1:PORT")


def _is_loopback(address: str) -> bool:
    return address.startswith(("ipc://", "inproc://", "tcp://127.", "tcp://localhost:", "tcp://[::1]:"))
