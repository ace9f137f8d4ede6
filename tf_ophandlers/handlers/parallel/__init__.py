"""`oh.ParallelHandler`: every op runs on several devices at once.

handler.py the handler and its values; collectives.py components that must run at the
same time; nest.py pack/unpack of nested structures; fit.py data-parallel `model.fit`;
optimizers.py the optimizer-step check."""
from tf_ophandlers.handlers.parallel.handler import (
    VARIABLE_READS, ParallelHandler, ParallelValue, ParallelVariable, refuse_tape_below)

__all__ = ["ParallelHandler", "ParallelValue", "ParallelVariable", "VARIABLE_READS",
           "refuse_tape_below"]
