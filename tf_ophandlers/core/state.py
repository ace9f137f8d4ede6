"""Per-thread dispatch state, and the interface of an execution *mode*.

`state` is the one per-thread object every layer reads (it imports nothing of the
package, so any module may import it):

`current`       the stack an op placed by scope runs on (PHYSICAL outside every scope;
                inside a hook of stack S it is S.next, so ops a handler runs go to its
                next handler).
`device`        the physical placement accumulated by `tf.device` inside handler scopes
                (RFC "Final handlers"): it applies at the bottom of the stack.
`frames`        the stacks whose hooks are running, innermost last; `OpHandler.next` and
                `oh.next_stack()` read the last one.
`scopes`        the open handler scopes of this thread, innermost last (core/scope.py).
`mode`          None while stacks run eagerly; a `Mode` while a function is replayed
                through them (core/functions/symbolic.py installs one).
`scope_placed`  whether the op being dispatched was placed by a scope (not by type).
`own_traces`    how many functions a handler is tracing for its own use right now
                (`own_trace()`: oh.vectorized_map's pfor function), not the program's
                step: a handler that treats the program's traced step specially (an
                eager oh.Recompute scope around a Keras fit step) leaves these alone.

Stacks (core/stack.py) ask the mode at a few fixed points and know nothing else of
function replay; the replay registers itself with the stack module instead (JAX's
"lower layers never import higher ones").
"""
import contextlib
import threading

from tensorflow.python.eager import context as _tf_context


def executing_eagerly():
    """`tf.executing_eagerly()` in one Python frame instead of three (per-op callers): the
    context's thread-local flag, read as TensorFlow's generated op wrappers read it."""
    ctx = _tf_context._context  # pylint: disable=protected-access
    if ctx is None:
        return _tf_context.executing_eagerly()
    return ctx._thread_local_data.is_eager  # pylint: disable=protected-access


class Mode:
    """How stacks run while a function is replayed through them (symbolic tensors).

    core/stack.py calls these while `building()` is true; core/functions/symbolic.py
    implements them. A mode is active on one thread (it is `state.mode` there).
    """

    def building(self):
        """Whether ops are being added to the replayed function right now (False for
        eager code that runs inside the replay, e.g. under `tf.init_scope`)."""
        raise NotImplementedError

    def represents(self, stack):
        """Whether `stack` is replayed symbolically (its tensors are shadow tensors)."""
        raise NotImplementedError

    def payload(self, tensor):
        """``(stack, representation)`` of a shadow tensor, or None."""
        raise NotImplementedError

    def wrap(self, stack, value):
        """A shadow tensor of `stack` whose representation is `value`."""
        raise NotImplementedError

    def emit(self, op, inputs):
        """Adds `op` to the function being built (the bottom of the replay)."""
        raise NotImplementedError

    def to_bottom(self, tensor):
        """`tensor` as a tensor of the replay's bottom."""
        raise NotImplementedError

    def executed(self, op, inputs, outputs):
        """A stack ran `op` on `inputs` (the tensors given to its `execute`) and made
        `outputs`: the replay notes it for `check_substitute`."""

    def check_substitute(self, stack, op, values, outputs):
        """The execute hook of `stack`, whose handler may change what ops compute, made
        `outputs` from `values` for `op`: the replay refuses a substitute it cannot
        differentiate (core/functions/symbolic.py)."""


_bottom = [None]  # PHYSICAL, registered by core/stack.py (which defines it)
_runtime_start = [None]  # core/dispatch.initialize, registered by core/dispatch.py


def register_runtime_start(start):
    """Called by core/dispatch.py: `start()` registers the dispatcher device and installs
    the runtime patches (idempotent). Lower layers call `start_runtime()` before using
    the C++ boundary (Op creation, merging a stack), so nothing starts at import."""
    _runtime_start[0] = start


def start_runtime():
    start = _runtime_start[0]
    if start is not None:
        start()


def register_bottom(stack):
    """Sets the stack `current` starts at on every thread (core/stack.py: PHYSICAL)."""
    _bottom[0] = stack
    state.current = stack


class _State(threading.local):
    def __init__(self):
        super().__init__()
        self.current = _bottom[0]
        self.device = ""
        self.frames = []
        self.scopes = []
        self.mode = None
        self.scope_placed = False
        self.own_traces = 0


state = _State()


@contextlib.contextmanager
def own_trace():
    """Marks the functions traced inside as traced by a handler for its own use (see
    `state.own_traces`), e.g. the pfor function of `oh.vectorized_map`."""
    state.own_traces += 1
    try:
        yield
    finally:
        state.own_traces -= 1
