"""The function library: FunctionDefs registered in the eager context, as FuncGraphs.

A replay interprets a function's body node by node; these helpers find bodies (cached
per name: a function name identifies one FunctionDef for the life of the context) and
walk a function's callees.
"""
from tensorflow.python.eager import context as _context
from tensorflow.python.framework import function_def_to_graph as _fdef_to_graph
from tensorflow.python.framework import ops as _ops

from tf_ophandlers.core import errors
from tf_ophandlers.core import tf_patches
from tf_ophandlers.core.cache import BoundedCache

# Function names are unique in the eager context (a retrace makes a new name), so a
# body or op-type set keyed by name cannot go stale.
def as_str(name):
    """A function name as str (TensorFlow gives them as bytes or str)."""
    return name.decode() if isinstance(name, bytes) else name


_bodies = BoundedCache("functions.bodies", 1024)  # name -> FuncGraph of its FunctionDef
_op_types = BoundedCache("functions.op_types", 4096)  # name -> op types of it and callees


def body(name):
    """The FuncGraph of the FunctionDef `name` registered in the eager context."""
    graph = _bodies.get(name)
    if graph is None:
        ctx = _context.context()
        if not ctx.has_function(name):
            raise errors.HandlerError(
                "tf_ophandlers: cannot replay function %s: it is not registered in the "
                "eager context" % name)
        fdef = ctx.get_function_def(name)
        with _ops.init_scope():  # nested functions are looked up in the eager context
            graph = _fdef_to_graph.function_def_to_graph(fdef)
        _bodies[name] = graph
    return graph


def function_library(names):
    """The FunctionDefs of the functions `names` and of every function they call (as op
    types or through function attributes: branches, loop bodies), callees first."""
    ctx = _context.context()
    seen, order = set(), []

    def visit(name):
        if name in seen or not ctx.has_function(name):
            return
        seen.add(name)
        fdef = ctx.get_function_def(name)
        for node in fdef.node_def:
            visit(node.op)
            for value in node.attr.values():
                if value.HasField("func"):
                    visit(value.func.name)
                for f in value.list.func:
                    visit(f.name)
        order.append(fdef)

    for name in names:
        visit(name)
    return order


def body_op_types(name):
    """The op types in function `name`'s body and in the functions it calls (for a
    handler's `replays_functions(op)` decision)."""
    types = _op_types.get(name)
    if types is None:
        types = _op_types[name] = frozenset(
            node.op for fdef in function_library([name]) for node in fdef.node_def)
    return types


def clear():
    _bodies.clear()
    _op_types.clear()


# -- functions TensorFlow releases -------------------------------------------------------
# A tf.function the program drops removes its functions from the eager context
# (AtomicFunction.__del__). What is cached here and in the replay cache (call.py) for
# such a name can never be used again, and holds graphs and registered functions: it is
# dropped then, as TensorFlow drops its own (not only when the bounded caches evict it).
_release_listeners = []  # fn(name), e.g. call.py's replay cache


def on_release(fn):
    """Calls ``fn(name)`` whenever TensorFlow removes function `name` from the context."""
    _release_listeners.append(fn)


def released(name):
    """Drops what is cached for function `name`, which TensorFlow just removed."""
    name = name.decode() if isinstance(name, bytes) else name
    _bodies.pop(name, None)
    _op_types.pop(name, None)
    for fn in _release_listeners:
        fn(name)


_original_remove_function = [None]


def _remove_function(self, name):
    _original_remove_function[0](self, name)
    try:
        released(name)
    except Exception:  # pylint: disable=broad-except
        pass  # (called from finalizers: never fail TensorFlow's removal)


def _install():
    _original_remove_function[0] = _context.Context.remove_function
    _context.Context.remove_function = _remove_function


tf_patches.register(
    "released functions", "tensorflow.python.eager.context.Context.remove_function",
    "TensorFlow has no callback for a function leaving the eager context (a dropped "
    "tf.function); the replays and bodies cached for it must go with it, or they keep "
    "its graphs and the replayed functions registered until evicted.",
    "runtime", _install, None)
