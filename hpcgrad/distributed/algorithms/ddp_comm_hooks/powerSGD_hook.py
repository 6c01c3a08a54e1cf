"""torch's ddp_comm_hooks.powerSGD_hook: PowerSGDState, powerSGD_hook, batched_powerSGD_hook."""  # noqa: N999

from ...powersgd_hook import PowerSGDState, batched_powerSGD_hook, powerSGD_hook  # noqa: F401
