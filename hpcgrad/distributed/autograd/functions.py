"""SendRpcBackward and RecvRpcBackward: where a backward pass leaves and re-enters a rank."""

import numpy as np

from ...autograd.engine import current_graph_task
from ...autograd.graph import Node
from ...tensor import Tensor


class SendRpcBackward(Node):
    """On the sender of a tensor: a root of its local backward, fed by the peer's gradients."""

    __slots__ = ("grads",)

    def __init__(self, edge):
        super().__init__([edge])
        self.grads = None

    def name(self):
        return "SendRpcBackward"

    def apply(self, grads):
        if self.grads is None:
            raise RuntimeError("SendRpcBackward ran without the gradients from its peer")
        return list(self.grads)


class RecvRpcBackward(Node):
    """On the receiver: a leaf of its local backward that ships the gradient to the sender.

    ``peer_context_id`` and ``message_id`` name the sender's SendRpcBackward. The gradient's
    reply is an outstanding RPC of the context whose backward runs this Node (normally
    ``context``; with SPMD send/recv, the receiver's own context).
    """

    __slots__ = ("context", "peer_context_id", "message_id", "peer", "send_grad")

    def __init__(self, context, peer_context_id, message_id, peer, tensor, send_grad):
        super().__init__([])
        self.context, self.peer_context_id = context, peer_context_id
        self.message_id, self.peer = message_id, peer
        self.send_grad = send_grad  # (this node, running graph task, array) -> None
        self.input_metadata = [(tensor.data.shape, tensor.data.dtype, tensor.device)]

    def name(self):
        return "RecvRpcBackward"

    def apply(self, grads):
        grad = grads[0]
        if grad is None:
            shape, dtype, _ = self.input_metadata[0]
            grad = Tensor._make(np.zeros(shape, dtype), False, None, 0)
        self.send_grad(self, current_graph_task(), grad.data)
        return []
