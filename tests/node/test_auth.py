"""CURVE on the node: a client whose key is in the allow-list reaches the node; one with another key, or
without CURVE, never does - its handshake is refused and counted, and the node's state is untouched."""

from __future__ import annotations

import threading

import pytest
import zmq
import zmq.auth

from luwu_rt.node.auth import client_keys, keygen
from luwu_rt.node.protocol import Message, T, encode
from luwu_rt.node.service import NodeConfig, NodeService


def _until(predicate, seconds: float = 20.0) -> bool:
    done = threading.Event()
    for _ in range(int(seconds / 0.05)):
        if predicate():
            return True
        done.wait(0.05)
    return predicate()


def _dealer(ctx, address: str, keys: tuple[bytes, bytes, bytes] | None):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = keys
    sock.connect(address)
    sock.send_multipart(encode(Message(T.HEARTBEAT, rank=0)))
    return sock


def test_only_allowed_keys_reach_the_node(tmp_path) -> None:
    keys = tmp_path / "keys"
    keygen(keys)
    (tmp_path / "elsewhere").mkdir()
    _, intruder_secret = zmq.auth.create_certificates(tmp_path / "elsewhere", "intruder")
    service = NodeService(NodeConfig(bind="tcp://127.0.0.1:*", num_workers=1, host_mem="16MiB",
                                     auth_keys=str(keys)), log=lambda line: None)
    ready = threading.Event()
    thread = threading.Thread(target=service.serve, kwargs={"ready": ready}, daemon=True)
    thread.start()
    assert ready.wait(20)
    ctx = zmq.Context()
    try:
        allowed = client_keys(keys / "worker.key_secret")
        node_public = allowed[2]
        public, secret = zmq.auth.load_certificate(intruder_secret)
        socks = [_dealer(ctx, service.address, (public, secret, node_public)), _dealer(ctx, service.address, None)]
        assert _until(lambda: service.rejects["auth"] >= 2), dict(service.rejects)
        assert service.rejects["peer"] == 0, "a message of a client without an allowed key reached the node"
        socks.append(_dealer(ctx, service.address, allowed))
        assert _until(lambda: service.rejects["peer"] == 1), dict(service.rejects)  # through, then refused: no HELLO
        assert service.manifest is None and service.runner is None and not service.peers
    finally:
        for s in locals().get("socks", []):
            s.close(0)
        ctx.term()
        service.stop()
        thread.join(20)
    assert not thread.is_alive()


def test_binding_beyond_loopback_needs_auth_keys() -> None:
    with pytest.raises(ValueError, match="needs --auth-keys DIR"):
        NodeConfig(bind="tcp://0.0.0.0:5555", num_workers=1)
    with pytest.raises(ValueError, match="luwu node keygen"):
        client_keys("/nonexistent/worker.key_secret")


def test_a_worker_names_a_node_that_is_not_there() -> None:
    """No node listens: joining fails within the worker's timeout, naming the address."""
    import socket

    from luwu_rt.node.client import NodeClient, NodeError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = NodeClient(f"tcp://127.0.0.1:{port}", rank=1, timeout_s=1.0, chunk_bytes=4096)
    try:
        with pytest.raises(NodeError, match=f"optimizer node at tcp://127.0.0.1:{port} said nothing"):
            client.connect({"num_workers": 2})
    finally:
        client.close()


def test_strategy_node_config_names_what_is_missing(tmp_path) -> None:
    from luwu_rt.engine import TrainConfig

    with pytest.raises(ValueError, match="strategy node needs --node"):
        TrainConfig(strategy="node")
    with pytest.raises(ValueError, match="applies to --strategy node"):
        TrainConfig(strategy="ddp", node="tcp://127.0.0.1:5555")
    from luwu_rt.engine.config import CheckpointConfig

    # Checkpoints of node runs read the optimizer state from the node (tests/node/test_node_checkpoint.py).
    TrainConfig(strategy="node", node="tcp://127.0.0.1:5555", checkpoint=CheckpointConfig(dir=str(tmp_path)))


class _Served:
    """A node service on a loopback port, its loop on a thread of the test process, its lines kept."""

    def __init__(self, **config) -> None:
        self.lines: list[str] = []
        self.service = NodeService(NodeConfig(bind="tcp://127.0.0.1:*", host_mem="16MiB", **config),
                                   log=self.lines.append)
        ready = threading.Event()
        self.thread = threading.Thread(target=self.service.serve, kwargs={"ready": ready}, daemon=True)
        self.thread.start()
        assert ready.wait(20)

    def stop(self) -> None:
        self.service.stop()
        self.thread.join(20)
        assert not self.thread.is_alive()


def _join_error(address: str, node_key=None, *, num_workers: int = 1, timeout_s: float = 60.0) -> tuple[str, float]:
    """What ``NodeClient.connect`` raised (it must raise), and after how many seconds."""
    import time

    from luwu_rt.node.client import NodeClient, NodeError

    client = NodeClient(address, rank=0, timeout_s=timeout_s, chunk_bytes=4096,
                        node_key=str(node_key) if node_key else None)
    start = time.monotonic()
    try:
        with pytest.raises(NodeError) as info:
            client.connect({"num_workers": num_workers}, None)
        return str(info.value), time.monotonic() - start
    finally:
        client.close(bye=False)


def test_a_refused_handshake_is_said_at_once_on_both_sides(tmp_path) -> None:
    """A worker without keys, or with a key the node does not allow, against a CURVE node, and one with a
    key against a node without CURVE: each join fails within seconds (not --timeout's 60) saying what to
    fix, and the CURVE node logged each refusal when it happened, the refused key named."""
    import shutil

    keys, elsewhere = tmp_path / "keys", tmp_path / "elsewhere"
    keygen(keys)
    elsewhere.mkdir()
    _, intruder = zmq.auth.create_certificates(elsewhere, "intruder")
    shutil.copy(keys / "node.key", elsewhere / "node.key")
    curve, plain = _Served(num_workers=1, auth_keys=str(keys)), _Served(num_workers=1)
    try:
        text, took = _join_error(curve.service.address)
        assert "CURVE keys" in text and "--node-key" in text and took < 15, (text, took)
        # The node saw either the mechanism mismatch or the worker hanging up on it first: both are said.
        assert any(line.startswith("refused a client") and "--node-key" in line for line in curve.lines), curve.lines
        text, took = _join_error(curve.service.address, intruder)
        assert f"does not allow this worker's key (--node-key {intruder}" in text and took < 15, (text, took)
        public = zmq.auth.load_certificate(intruder)[0].decode()
        assert any(f"refused a client key {public}" in line for line in curve.lines), curve.lines
        text, took = _join_error(plain.service.address, keys / "worker.key_secret")
        # The worker saw the mismatch itself, or the node hanging up on it first: either way it is said.
        assert "without --auth-keys" in text and "leave out --node-key" in text and took < 15, (text, took)
        assert curve.service.rejects["auth"] >= 2 and curve.service.manifest is None
    finally:
        curve.stop()
        plain.stop()


def test_joining_ends_within_the_timeout_when_the_node_never_welcomes() -> None:
    """The node answers every heartbeat but waits for a second worker that never comes: the join ends after
    --timeout, saying what the node waits for (it waited forever before)."""
    from test_protocol import manifest

    node = _Served(num_workers=2)
    try:
        m = manifest()
        from luwu_rt.node.client import NodeClient, NodeError

        client = NodeClient(node.service.address, rank=0, timeout_s=2.0, chunk_bytes=4096)
        result: list[BaseException] = []

        def join() -> None:
            try:
                client.connect(m, None)
            except BaseException as exc:
                result.append(exc)

        thread = threading.Thread(target=join, daemon=True)
        thread.start()
        thread.join(20)
        client.close(bye=False)
        assert not thread.is_alive(), "the join did not end within its timeout"
        assert isinstance(result[0], NodeError) and "no WELCOME" in str(result[0]) and "all 2" in str(result[0])
    finally:
        node.stop()


def _train(address: str, tmp_path, *extra: str):
    import os
    import subprocess
    import sys

    from luwu_rt.exec.chaos import CHAOS_ENV

    return subprocess.Popen([sys.executable, "-m", "luwu_rt", "train", "--strategy", "node", "--node", address,
                             "--steps", "2", "--batch-size", "1", "--seq-len", "16", "--eval-every", "0", "--quiet",
                             "--keep-graphs", "none", *extra], cwd=tmp_path, env={**os.environ, CHAOS_ENV: ""},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_luwu_train_without_keys_against_a_curve_node_fails_in_one_line(tmp_path) -> None:
    keygen(tmp_path / "keys")
    node = _Served(num_workers=1, auth_keys=str(tmp_path / "keys"))
    try:
        proc = _train(node.service.address, tmp_path, "--timeout", "120")
        out, err = proc.communicate(timeout=100)  # far less than --timeout: the refusal is seen at once
    finally:
        node.stop()
    errors = [line for line in err.splitlines() if line.startswith("luwu: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "CURVE keys" in errors[0], err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def test_sigterm_ends_a_worker_waiting_for_a_silent_node(tmp_path) -> None:
    """A single worker whose node accepts the connection and never answers: SIGTERM stops it within seconds
    (exit 143, one line saying what it waited for), not after --timeout."""
    import signal
    import subprocess

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        proc = _train(f"tcp://127.0.0.1:{port}", tmp_path, "--timeout", "120")
        try:
            assert router.poll(120_000), "the worker never said HELLO"  # it waits in its join from here on
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"SIGTERM did not stop the worker:\n{err[-3000:]}") from None
    finally:
        router.close()
        ctx.term()
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, err[-3000:])
    assert "luwu: SIGTERM: stopped waiting for the optimizer node" in err and "Traceback" not in err, err[-3000:]
