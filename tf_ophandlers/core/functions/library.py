"""The function library: FunctionDefs registered in the eager context, as FuncGraphs.

A replay interprets a function's body node by node; these helpers find bodies (cached
per name: a function name identifies one FunctionDef for the life of the context) and
walk a function's callees.
"""
from tensorflow.python.eager import context as _context
from tensorflow.python.eager.polymorphic_function import atomic_function as _atomic
from tensorflow.python.eager.polymorphic_function import function_type_utils as _ftype
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


def _callee_names(attrs):
    """The function names an op's attributes (AttrValue protos) hold."""
    names = []
    for value in attrs.values():
        if value.HasField("func"):
            names.append(as_str(value.func.name))
        names.extend(as_str(f.name) for f in value.list.func)
    return [n for n in names if n]


def _in_graph(graph, name):
    """Whether `graph` or a graph it is nested in has function `name` in its library
    (where TensorFlow's control-flow gradients look a branch or loop body up)."""
    while graph is not None:
        if graph._is_function(name):  # pylint: disable=protected-access
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


# AtomicFunctions standing for context functions that no AtomicFunction owned (added as
# bare FunctionDefs): dropping one would remove its function from the context, which
# its owner never does, so they are kept.
_unowned = {}  # (function scope id, name) -> AtomicFunction


def _context_function(name):
    """An AtomicFunction for function `name` of the eager context, for a graph's library.

    It holds a reference to the context's function, as TensorFlow's own AtomicFunctions
    do: the function stays registered while a graph using it is alive."""
    ctx = _context.context()
    key = (ctx.function_scope_id, name.encode())
    owned = key in _atomic.RUNTIME_FUNCTION_REFS
    function = _atomic.AtomicFunction(name, ctx, _ftype.derive_from_graph(body(name)))
    if not owned:
        _unowned.setdefault(key, function)
    return function


def register_callees(graph, attrs):
    """Adds to `graph`'s function library the functions an op being added to it names
    in its attributes `attrs` (branches, loop condition and body), and the functions
    they call, where neither `graph` nor a graph it is nested in has them.

    The op runs without this (the runtime finds them in the eager context), but
    TensorFlow's If/Case/While gradients look a branch or loop body up by name in the
    op's graph and the graphs it is nested in: without it, differentiating a function
    holding such an op fails ("... cannot be found in the graph")."""
    names = _callee_names(attrs)
    if not names:
        return
    for fdef in function_library(names):  # callees first
        name = fdef.signature.name
        if not _in_graph(graph, name):
            graph._add_function(_context_function(name))  # pylint: disable=protected-access


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


def _wrap_remove_function(original):
    _original_remove_function[0] = original
    return _remove_function


tf_patches.subscribe("Context.remove_function", "released functions", _wrap_remove_function)
