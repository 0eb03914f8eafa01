"""The optimizer node of strategy ``node``: protocol, service, worker client, keys ([Note: the node protocol]
in protocol.py, [Note: the node's threads] in service.py, [Note: the worker under strategy node] in worker.py)."""

from luwu_rt.node.config import NodeConfig
from luwu_rt.node.service import NodeService

__all__ = ["NodeConfig", "NodeService"]
