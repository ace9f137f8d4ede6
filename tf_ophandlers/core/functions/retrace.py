"""Re-tracing a function's Python body under substituting handlers (RFC "Three types of
interactions with functions": during tracing).

A replay (call.py) interprets a function's traced body node by node. A function that
holds gradient ops (a `tf.GradientTape` inside it, Keras `fit`'s train step) has them
built for its original ops when it was traced: replayed under a handler that runs
something else in place of an op (`OpHandler.changes_computation`), they would
differentiate what did not run. Such a call is instead *re-traced*: the function's
Python body runs again, inside the replayed function being built, with the segment's
handlers as the current stack, so every op it creates (forward, and the gradient ops
its tape builds) runs through the handlers, as eagerly in their scope. The tape inside
records the ops the user's code called; where a handler substituted one, the record of
what ran below (its inputs and outputs as nodes of the function) is kept on the replay,
and TensorFlow's gradient function (handlers/substitutes.py) takes the symbolic
gradient of those nodes (`tf.gradients`) in place of the called op's. Control flow the
body builds (cond_v2/while_v2 trace branches and loop bodies as functions of their own)
is interpreted on the handlers as a replay's is, and recorded the same way as a whole
(symbolic.py, `Replay._retraced_control_flow`).

The Python function behind a traced function's name is noted when TensorFlow traces it
(one patch, from the first handler scope on; a function traced before is looked for
once among the live `tf.function` objects): a weak reference, so a dropped
`tf.function` is not kept alive. Handlers that declare `changes_computation = False`
never re-trace. The re-traced function is cached like any replay (call.py's key: the
function's name, argument summaries and specs, the handlers' cache keys and types).
"""
import gc
import weakref

from tensorflow.python import pywrap_tfe
from tensorflow.python.autograph.core import ag_ctx as _ag_ctx
from tensorflow.python.eager.polymorphic_function import polymorphic_function as _polymorphic
from tensorflow.python.framework import ops as _ops
from tensorflow.python.framework.tensor import Tensor as _Tensor
from tensorflow.python.ops import array_ops as _array_ops
from tensorflow.python.ops import gradients_util as _gradients_util
from tensorflow.python.util import nest as _nest

from tf_ophandlers.core import errors
from tf_ophandlers.core import tf_patches
from tf_ophandlers.core.cache import BoundedCache
from tf_ophandlers.core.functions import call_records as _call_records
from tf_ophandlers.core.functions import library
from tf_ophandlers.core.stack import payload
from tf_ophandlers.core.state import state

# Inference function name -> weak references to the Python function TensorFlow traced
# and to its ConcreteFunction (whose FunctionType, kept, would keep TensorShapes and specs
# of every function ever traced), and its autograph setting (enabled, options): the
# function is autograph's handler, which converts only while autograph is enabled, as
# TensorFlow enables it around the trace. Names are unique in the eager context.
_sources = BoundedCache("functions.retrace_sources", 2048)
_scanned = BoundedCache("functions.retrace_scanned", 256)  # names looked for by `_scan`
_on_retrace = []  # callbacks run before a re-trace (handlers/substitutes.py's patch)


def on_retrace(fn):
    """Calls ``fn()`` before each re-trace (installs what the gradients need)."""
    _on_retrace.append(fn)


_original_create_concrete_function = [None]


def _create_concrete_function(function_type, type_context, func_graph, tracing_options):
    concrete = _original_create_concrete_function[0](
        function_type, type_context, func_graph, tracing_options)
    try:
        python_function = tracing_options.python_function
        name = library.as_str(concrete._inference_function.name)  # pylint: disable=protected-access
        _sources[name] = (weakref.ref(python_function), weakref.ref(concrete),
                          (tracing_options.autograph, tracing_options.autograph_options))
    except (AttributeError, TypeError):
        pass  # (not weakly referenceable, or no inference function: no re-trace)
    return concrete


def _wrap_create_concrete_function(original):
    _original_create_concrete_function[0] = original
    return _create_concrete_function


tf_patches.subscribe("tracing_compilation._create_concrete_function",
                     "traced python functions", _wrap_create_concrete_function)


def _scan(name):
    """Notes the Python functions of the `tf.function` that traced `name` before the
    patch above was installed (a step called once before the first handler scope
    opened), found among the live `tf.function` objects: a walk of the garbage
    collector's objects, once per such function (what it finds is noted)."""
    if name in _scanned:
        return
    _scanned[name] = True
    for obj in gc.get_objects():
        if not isinstance(obj, _polymorphic.Function):
            continue
        configs = [c for c in (getattr(obj, "_no_variable_creation_config", None),
                               getattr(obj, "_variable_creation_config", None))
                   if c is not None]
        if not configs:
            continue
        names = {}
        try:
            for concrete in configs[0].function_cache.values():
                names[library.as_str(concrete._inference_function.name)] = concrete  # pylint: disable=protected-access
        except (AttributeError, TypeError):
            continue
        if name in names:
            fn = configs[0].python_function  # (autograph's conversion, as traced)
            autograph = (getattr(obj, "_autograph", True),
                         getattr(obj, "_experimental_autograph_options", None))
            for other, concrete in names.items():
                _sources[other] = (weakref.ref(fn), weakref.ref(concrete), autograph)
            return


def source(name):
    """(python_function, function_type, (autograph, autograph options)) of traced
    function `name`, or None (its tf.function is gone)."""
    entry = _sources.get(name)
    if entry is None:
        _scan(name)
        entry = _sources.get(name)
    if entry is None:
        return None
    fn, concrete = entry[0](), entry[1]()
    if fn is None or concrete is None:
        return None
    return fn, concrete.function_type, entry[2]


def _released(name):
    _sources.pop(name, None)
    _scanned.pop(name, None)


library.on_release(_released)  # (the names of a dropped tf.function)


def why_not(name, scope_placed):
    """Why function `name` cannot be re-traced ("" if it can)."""
    if not scope_placed:
        return ("its call was not placed by a handler scope (re-tracing runs the body in "
                "the scope's handlers)")
    if _call_records.is_forward_call(name):
        # TensorFlow's tape outside builds the call's backward function from the traced
        # body, whatever the replay runs (call.py refuses that call anyway).
        return "a TensorFlow tape outside records the call"
    found = source(name)
    if found is None:
        return "its Python function is unknown (its tf.function is gone)"
    for p in found[1].parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            return "its signature has variable-length parameters"
    aliases = [t._alias_id() for t in found[1].flat_inputs]  # pylint: disable=protected-access
    aliases = [a for a in aliases if a is not None]
    if len(set(aliases)) != len(aliases):
        return "an argument is passed twice (aliased)"
    return ""


def _pack(function_type, flat):
    """The Python arguments (args, kwargs) for the flat call inputs `flat`."""
    it = iter(flat)
    values = {}
    for p in function_type._sorted_parameters:  # pylint: disable=protected-access
        values[p.name] = p.type_constraint.from_tensors(it)
    args, kwargs = [], {}
    for p in function_type.parameters.values():
        if p.kind is p.KEYWORD_ONLY:
            kwargs[p.name] = values[p.name]
        else:
            args.append(values[p.name])
    return args, kwargs


def run_body(replay, name, args, num_outputs, stack=None):
    """Runs the Python body of function `name` on `args` (the call's flat inputs as
    tensors of the segment) inside the replayed function being traced, with `stack`
    (default: the segment's top) as the current stack; returns its flat outputs."""
    python_function, function_type, (autograph, autograph_options) = source(name)
    for fn in _on_retrace:
        fn()
    n = len(function_type.flat_inputs)
    py_args, py_kwargs = _pack(function_type, args[:n])
    saved, retracing = state.current, replay.retracing
    state.current = replay.segment[0] if stack is None else stack
    replay.retracing = True
    stopped = pywrap_tfe.TFE_Py_TapeSetIsStopped()
    if stopped:  # the tape inside the body must record (replays run with recording off)
        pywrap_tfe.TFE_Py_TapeSetRestartOnThread()
    try:
        with _ag_ctx.ControlStatusCtx(
                status=_ag_ctx.Status.ENABLED if autograph else _ag_ctx.Status.DISABLED,
                options=autograph_options):
            structured = python_function(*py_args, **py_kwargs)
        flat = []
        for o in _nest.flatten(structured, expand_composites=True):
            if o is None:
                continue
            if not isinstance(o, _Tensor):
                o = _ops.convert_to_tensor(o)
            flat.append(o)
    finally:
        if stopped:
            pywrap_tfe.TFE_Py_TapeSetStopOnThread()
        replay.retracing = retracing
        state.current = saved
    if len(flat) != num_outputs:
        raise errors.HandlerError(
            "tf_ophandlers: re-tracing function %s under %s gave %d outputs where its "
            "trace gave %d" % (name, replay.segment[0].handler.debug_string(), len(flat),
                               num_outputs))
    return flat


class SymbolicRecord:
    """What a substituting hook ran for one op while a body is re-traced: its inputs and
    outputs as nodes of the function (the bottom), for the tape's backward pass."""

    __slots__ = ("stack", "op_type", "sources", "targets")

    def __init__(self, stack, op_type, sources, targets):
        self.stack = stack  # the stack of the substituting handler
        self.op_type = op_type
        self.sources = sources  # per op input: a bottom tensor, or None
        self.targets = targets  # per op output: a bottom tensor, or None

    def gradients(self, replay, out_grads, num_inputs):
        """The gradient of what ran, as nodes of the function (`tf.gradients`)."""
        targets, grad_ys = [], []
        for t, g in zip(self.targets, out_grads):
            if t is None or not (t.dtype.is_floating or t.dtype.is_complex):
                continue
            targets.append(t)
            grad_ys.append(g)
        sources = [s for s in self.sources if s is not None]
        if not targets or not sources:
            return [None] * num_inputs
        saved = state.current
        state.current = replay.bottom  # the gradient's ops are nodes, below the handlers
        try:
            grad_ys = [_array_ops.zeros_like(t) if g is None else replay.to_bottom(g)
                       for t, g in zip(targets, grad_ys)]
            # Partial derivatives, as a gradient function gives: where one input is
            # computed from another (tf.cond's branches capturing a loss and the
            # activation it came from), the tape carries the path between them itself.
            got = iter(_gradients_util._GradientsHelper(  # pylint: disable=protected-access
                targets, sources, grad_ys, stop_gradients=sources))
            grads = [None if s is None else next(got) for s in self.sources]
        finally:
            state.current = saved
        # As tensors of the handler's stack, like the gradients of the ops it ran as they
        # were (code that checks that its gradients share one graph: tf.custom_gradient
        # in Keras's gradient all-reduce).
        return [None if g is None else self.stack.copy_on(g) for g in grads]


def bottom_value(tensor):
    """`tensor` (a shadow tensor of the segment, or a node) as a node of the function, if
    its representations down to the bottom are tensors; else None."""
    while isinstance(tensor, _Tensor):
        p = payload(tensor)
        if p is None:
            return tensor
        tensor = p[1]
    return None
