"""`oh.DebuggerHandler`: TensorFlow Debugger V2 (tfdbg) dumps from a handler.

handler.py the handler; events.py the tfdbg V2 file set and the debug values."""
from tf_ophandlers.handlers.debugger.handler import DebuggerHandler

__all__ = ["DebuggerHandler"]
