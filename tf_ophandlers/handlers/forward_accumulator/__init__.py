"""`oh.ForwardAccumulator`: forward-mode autodiff as an op handler.

handler.py the handler; jvp.py the JVP rules of common ops; rules.py the MaxPool rule and
what nested accumulators need; custom_gradients.py JVPs of gradients recorded from Python."""
from tf_ophandlers.handlers.forward_accumulator.handler import Dual, ForwardAccumulator

__all__ = ["Dual", "ForwardAccumulator"]
