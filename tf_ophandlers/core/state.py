"""Per-thread dispatch state.

`current`  the stack an op placed by scope runs on (PHYSICAL outside every scope; inside a
           hook of stack S it is S.next, so ops a handler runs go to its next handler).
`device`   the physical placement accumulated by `tf.device` inside handler scopes (RFC
           "Final handlers"): it applies at the bottom of the stack.
`frames`   the stacks whose hooks are running, innermost last; `OpHandler.next` reads it.
`scopes`   tokens of open handler scopes, for exit.

The object itself is defined next to the stacks (core/stack.py), which read it on every
op; this module is its documented home.
"""
from tf_ophandlers.core.stack import state  # noqa: F401
