"""`oh.Recompute`: automatic gradient checkpointing as an op handler.

handler.py the handler; segments.py recorded runs of ops a tape sees as one operation;
evict.py dropping held values; thinning.py dropping checkpoints the backward pass
computes again; conv_grads.py lean convolution gradients; graph.py recompute inside a
traced function; calls.py called tf.functions."""
from tf_ophandlers.handlers.recompute.handler import EXPENSIVE_OPS, Recompute

__all__ = ["EXPENSIVE_OPS", "Recompute"]
