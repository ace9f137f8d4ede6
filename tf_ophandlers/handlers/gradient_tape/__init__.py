"""`oh.GradientTape`: reverse-mode autodiff as an op handler.

handler.py the handler (recording, `gradient`); backward.py the backward pass;
exclusions.py which inputs and outputs a gradient function reads; hooks.py gradients
recorded from Python; static_gradients.py gradients from static shapes."""
from tf_ophandlers.handlers.gradient_tape.handler import (
    SOURCE_GRADIENT_NODE, UID_SHIFT, GradientTape, recording_tapes)

__all__ = ["GradientTape", "SOURCE_GRADIENT_NODE", "UID_SHIFT", "recording_tapes"]
