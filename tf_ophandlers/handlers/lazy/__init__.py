"""`oh.Lazy`: ops accumulate instead of running; a value request compiles and runs them.

handler.py the handler; compiler.py the process-wide cache of compiled functions."""
from tf_ophandlers.handlers.lazy.handler import Lazy, LazyValue

__all__ = ["Lazy", "LazyValue"]
