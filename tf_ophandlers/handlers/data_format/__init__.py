"""`oh.DataFormat`: channels-first models on the CPU, layout as an op handler.

handler.py the handler; rules.py the representation `Permuted` and the layout rules."""
from tf_ophandlers.handlers.data_format.handler import DataFormat

__all__ = ["DataFormat"]
