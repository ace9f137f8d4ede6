"""Per-call side effects for handlers: acting at every execution of a replayed function.

A `tf.function` (Keras `fit`'s train step) called under handlers is replayed through them
once per cache entry (core/functions): a hook sees each op of the body once, at replay
time, and whatever it does in Python happens once. What it does with TensorFlow ops
becomes part of the replayed function and happens at every call (that is how
`CheckNumericsHandler`'s checks run at every step). `at_every_call` is the general way to
run Python code at every call:

    class CountOps(oh.OpHandler):
        def __init__(self):
            self.count = 0

        def _add(self, op_types):
            self.count += len(op_types)

        def execute(self, op, inputs):
            outputs = self.next.execute(op, inputs)
            oh.per_call.at_every_call(self, op.type, self._add)
            return outputs

Eagerly, `callback([item])` runs at once. While a function is replayed, the items a handler
adds to the graph being built are collected, and the first one adds one stateful
`tf.numpy_function` node to that graph, which calls `callback(items)` with all of them
each time the graph runs: one Python call per function call (per iteration for a loop
body, only when taken for a cond branch), whatever the number of ops. The probe traces
the replay makes of branches and loop bodies are never run, so they add nothing.

Examples:
    >>> class CountSteps(oh.OpHandler):
    ...     def __init__(self):
    ...         self.calls = 0
    ...     def execute(self, op, inputs):
    ...         if op.type == "Sin":
    ...             oh.per_call.at_every_call(self, None, self._count)
    ...         return self.next.execute(op, inputs)
    ...     def _count(self, items):
    ...         self.calls += 1
    >>> f = tf.function(lambda x: tf.sin(x))
    >>> counter = CountSteps()
    >>> with counter:
    ...     for _ in range(3):
    ...         _ = f(tf.constant(1.0))
    >>> counter.calls
    3
"""
import weakref

import tensorflow as tf
from tensorflow.python.framework import ops as _ops

from tf_ophandlers.core.state import state

_pending = weakref.WeakKeyDictionary()  # graph being built -> {key: [items]}


def replaying():
    """Whether the calling hook runs while a function is being replayed: its tensors are
    symbolic (no `.numpy()`), shapes may be partially unknown, and its TensorFlow calls
    become nodes of the replayed function (they run at every call)."""
    mode = state.mode
    return mode is not None and mode.building()


def at_every_call(key, item, callback):
    """Arranges for `callback(items)` to run at every execution of the code being run.

    Eagerly: `callback([item])` now. While a function is replayed: `item` joins the list
    kept for (`key`, the graph being built); the first item for that pair adds one node to
    the graph that calls `callback(list_of_items)` each time the replayed function (or
    branch, or loop body) runs. `key` is usually the handler (one list per handler and
    graph); `callback` runs on a TensorFlow executor thread, holding the GIL, and must not
    raise (an exception becomes a `tf.errors.UnknownError` of the call).
    """
    if not replaying():
        callback([item])
        return
    graph = _ops.get_default_graph()
    lists = _pending.get(graph)
    if lists is None:
        lists = _pending[graph] = {}
    items = lists.get(key)
    if items is None:
        items = lists[key] = []

        def run():
            callback(items)
            return []

        # No inputs and no outputs: a stateful node that automatic control dependencies
        # keep in the function (it runs at every call).
        tf.numpy_function(run, [], [], stateful=True, name="oh_every_call")
    items.append(item)
