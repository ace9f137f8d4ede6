"""`oh.ParallelHandler`: every op runs on several devices at once.

handler.py the handler and its values; collectives.py components that must run at the
same time; nest.py pack/unpack of nested structures; fit.py data-parallel `model.fit`.
(The optimizer-step check it shares with other per-device handlers is core/per_device.py.)"""
from tf_ophandlers.handlers.parallel.handler import (
    ParallelHandler, ParallelValue, ParallelVariable)

__all__ = ["ParallelHandler", "ParallelValue", "ParallelVariable"]
