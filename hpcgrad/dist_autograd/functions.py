"""SendRpcBackward and RecvRpcBackward: where a backward pass leaves and re-enters a rank.

As in PyTorch's distributed autograd, one pair per RPC message: the sender's SendRpcBackward
has one next edge per tensor of the message that requires grad, the receiver's RecvRpcBackward
one output per tensor (in the same order). A message is the unit of the backward pass: its
RecvRpcBackward runs when any of its tensors is used, and sends every gradient at once (zeros
for the unused ones), so the peer's SendRpcBackward always gets its gradients.
"""

from hpcgrad.base import backend
from hpcgrad.autograd.engine import current_graph_task
from hpcgrad.autograd.graph import Node


class SendRpcBackward(Node):
    """On the sender of a message: a root of its local backward, fed by the peer's gradients."""

    __slots__ = ("grads",)

    def __init__(self, edges):
        super().__init__(list(edges))
        self.grads = None

    def name(self):
        return "SendRpcBackward"

    def set_grads(self, arrays, make_tensor):
        """The peer's gradients (host arrays off the wire), each moved to the device its edge's
        Node expects (a GPU tensor sent by RPC travels as a host copy)."""
        grads = []
        for array, edge in zip(arrays, self.next_edges):
            if edge is not None:
                node, input_nr = edge
                array = backend.to_device(array, node.input_metadata[input_nr][2])
            grads.append(make_tensor(array))
        self.grads = grads

    def apply(self, grads):
        if self.grads is None:
            raise RuntimeError("SendRpcBackward ran without the gradients from its peer")
        grads, self.grads = self.grads, None  # handed on, not kept: a lone gradient can be
        return grads                          # stolen by the context (Note [Stolen gradients])


class RecvRpcBackward(Node):
    """On the receiver: a leaf of its local backward that ships the gradients to the sender.

    ``peer_context_id`` and ``message_id`` name the sender's SendRpcBackward. The reply is an
    outstanding RPC of the pass that runs this Node (its GraphTask's attached state).
    """

    __slots__ = ("context", "peer_context_id", "message_id", "peer", "send_grad")

    def __init__(self, context, peer_context_id, message_id, peer, tensors, send_grad):
        super().__init__([])
        self.context, self.peer_context_id = context, peer_context_id
        self.message_id, self.peer = message_id, peer
        self.send_grad = send_grad  # (this node, running graph task, [array]) -> None
        self.input_metadata = [(t.array.shape, t.array.dtype, t.device) for t in tensors]

    def name(self):
        return "RecvRpcBackward"

    def apply(self, grads):
        arrays = []
        for grad, (shape, dtype, device) in zip(grads, self.input_metadata):
            # An unused output's gradient: zeros where the tensor lived, as PyTorch's
            arrays.append(backend.zeros(shape, dtype, device) if grad is None else grad.array)
        self.send_grad(self, current_graph_task(), arrays)
        return []

