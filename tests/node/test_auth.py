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
