"""torch's ddp_comm_hooks.default_hooks: the all-reduce and fp16/bf16 compression hooks and wrappers."""

from ...comm_hooks import (allreduce_hook, bf16_compress_hook, bf16_compress_wrapper,  # noqa: F401
                           fp16_compress_hook, fp16_compress_wrapper)
