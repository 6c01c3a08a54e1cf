"""hpcgrad.distributed.nn.api: RemoteModule (torch.distributed.nn.api's layout)."""

from .remote_module import RemoteModule  # noqa: F401
