"""A Keras optimizer step checked before it writes anything, in the scope of handlers
whose variables live per device (`oh.ParallelHandler`, `oh.Mesh`: they declare
`holds_variable(variable)`). A host variable among those the step writes (its
`iterations`, slots, the trained weights) fails there only at its own write, which comes
after the weights changed: a retry would apply the step twice.
"""
from tf_ophandlers.core import errors
from tf_ophandlers.core import tf_patches as _tf_patches
from tf_ophandlers.core.stack import current_stack


def check_optimizer_step(optimizer, trainable_variables):
    """Raises `PlacementError` before a Keras optimizer step writes anything if a
    variable it writes (its `iterations`, its slots, the trained variables) is a host
    variable of a Parallel or Mesh scope on the current stack (a handler with
    `holds_variable`). Checked per op, the error would come at the first write to such a
    variable: after the weights were updated, so a retry would apply the step twice."""
    handlers = [h for h in current_stack().handlers if hasattr(h, "holds_variable")]
    if not handlers:
        return
    rate = getattr(optimizer, "_learning_rate", None)  # read by the step, not written
    writes = [optimizer.iterations] + [v for v in optimizer.variables
                                       if v is not rate and v is not optimizer.iterations]
    writes += [v for v in (trainable_variables or ()) if v is not None]
    for h in handlers:
        for v in writes:
            if getattr(v, "handle", None) is not None and not h.holds_variable(v):
                kind = type(h).__name__
                raise errors.PlacementError(
                    "oh.%s: %s.apply would write variable %r, created outside %s, once "
                    "per %s; nothing was written. This optimizer's variables stay outside "
                    "(building it again does nothing): make a new one inside the scope. "
                    "For a Keras model, build and compile it inside the scope (`with %s: "
                    "model = ...; model.compile(...)`); in a custom loop, `with %s: "
                    "optimizer = keras.optimizers.%s(...)%s"
                    % (kind, type(optimizer).__name__, getattr(v, "path", None) or v.name,
                       h.debug_string(), "device" if kind == "Mesh" else "component",
                       "mesh" if kind == "Mesh" else "parallel",
                       "mesh" if kind == "Mesh" else "parallel", type(optimizer).__name__,
                       # (a Mesh replay creates the variables of an unbuilt optimizer)
                       "`" if kind == "Mesh" else
                       "; optimizer.build(model.trainable_variables)` before the first "
                       "tf.function step"))


def _wrap_apply(original):
    def apply(self, grads, trainable_variables=None):
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        check_optimizer_step(self, trainable_variables if trainable_variables is not None
                             else getattr(self, "_trainable_variables", None))
        return original(self, grads, trainable_variables)
    return apply


_tf_patches.subscribe("BaseOptimizer.apply", "keras optimizer step check", _wrap_apply)


def ensure_optimizer_check():
    """Installs the Keras optimizer-step check (a ParallelHandler or Mesh exists)."""
    _tf_patches.ensure("keras optimizer step check")
