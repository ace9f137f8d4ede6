"""`ForwardAccumulator`: forward-mode autodiff as an op handler (RFC "Proposal").

The representation of a tensor pairs its primal (a tensor of the next stack) with its
tangent (a tensor of the next stack, or None for zero). Every op placed on the
accumulator runs on the primals; when an input has a tangent, the op's Jacobian-vector
product runs next to it, on the next stack, so accumulators nest (higher order) and
compose with tapes (forward-over-reverse and reverse-over-forward).

>>> import tensorflow as tf, tf_ophandlers as oh
>>> x = tf.constant(2.0)
>>> with oh.ForwardAccumulator(x, tf.constant(1.0)) as acc:
...     y = x * x * x
>>> float(acc.jvp(y))
12.0

JVP rules: linear ops (reshapes, slices, sums, concatenations, additions, copies) rerun
the same op on the tangents; multilinear ops (Mul, MatMul, convolutions, einsum) apply the
product rule with the same op; common elementwise and softmax ops have closed forms.
Every other op with a registered gradient uses TensorFlow's own construction
(`forwardprop._jvp_helper`: the transpose of the gradient function, traced once per op
signature into a function cached here).
"""
import logging
import weakref

import tensorflow as tf
from tensorflow.core.function.polymorphism import function_cache as _function_cache
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import forwardprop as _tf_forwardprop
from tensorflow.python.eager import record as _record
from tensorflow.python.eager.polymorphic_function import tracing_compilation as _tracing_compilation
from tensorflow.python.ops.unconnected_gradients import UnconnectedGradients
from tensorflow.python.util import nest

from tf_ophandlers.extend import (
    current_stack, errors, next_stack, Op, OpHandler, own_handle, record_on_tf_tapes,
    recording_restarted, register_external_cache, registries as _registries,
    representation_of, stack_of, state, subscribe_records, tensor_key)
from tf_ophandlers.handlers.forward_accumulator import custom_gradients as _custom
from tf_ophandlers.handlers.forward_accumulator import rules as _more_rules
from tf_ophandlers.handlers.forward_accumulator.jvp import (
    COMPLEX_ENUMS as _COMPLEX_ENUMS, DIFFERENTIABLE_ENUMS as _DIFFERENTIABLE_ENUMS,
    FLOAT_ENUMS as _FLOAT_ENUMS, REAL_ONLY as _REAL_ONLY, RULES as _RULES,
    dtype_enum as _enum, is_float as _float, multilinear as _multilinear, zeros as _zeros)

_log = logging.getLogger("tf_ophandlers")
_key = tensor_key  # tensors are keyed by TensorFlow handle
_tape_set_is_empty = pywrap_tfe.TFE_Py_TapeSetIsEmpty
_RESOURCE = tf.resource.as_datatype_enum
_FORWARDS_HANDLE = frozenset(("Identity", "IdentityN"))  # output i is input i


class Dual:
    """The accumulator's representation: a primal and its tangent (None means zero)."""

    __slots__ = ("primal", "tangent")

    def __init__(self, primal, tangent):
        self.primal = primal
        self.tangent = tangent

    # A Dual has its primal's dtype and shape: OpHandler's default hooks read them.
    dtype = property(lambda self: self.primal.dtype)
    shape = property(lambda self: self.primal.shape)

    def __repr__(self):
        return "Dual(%r, %r)" % (self.primal, self.tangent)


def _tapes_recording():
    """Lets TensorFlow's tapes record on this thread while a JVP is built.

    TensorFlow builds a JVP by recording the op's gradient function on two inner
    GradientTapes. Tapes record nothing while the thread's tape set is stopped, which is
    the case while a tf.function is replayed through handlers (core/functions traces
    under `stop_recording`): the JVP would silently be zero, and a cache of traced JVP
    functions keyed by op, attrs and input specs would keep that trace for every later
    use of the op, eager ones too. The accumulator's own state decides whether it
    computes tangents.
    """
    return recording_restarted()


def _jvp_body(op_name, attr_tuple, inputs, outputs, tangents):
    """The body of a traced JVP function: TensorFlow's construction, with the tapes it
    uses recording inside the trace only (a graph being built: the tapes of the eager
    program around, stopped or not, see none of it)."""
    with _tapes_recording():
        return _tf_forwardprop._jvp_helper(  # pylint: disable=protected-access
            op_name, attr_tuple, inputs, outputs, tangents)


# The accumulator's own cache of traced JVP functions (as forwardprop._jvp_dispatch, but
# never sharing traces with tf.autodiff.ForwardAccumulator, and traced with the tapes
# recording wherever the call happens). TensorFlow's function cache keys a trace by the
# arguments (op name, attrs, input specs) and the calling context. Bounded (each new
# input shape of an op is a new trace for its first 32 traces): emptied when full.
_JVP_FUNCTIONS_MAX = 1024
_jvp_function_cache = _function_cache.FunctionCache()
register_external_cache("forward_accumulator.jvp_functions",
                        lambda: (len(_jvp_function_cache), _JVP_FUNCTIONS_MAX))
_jvp_exact = _tracing_compilation.TracingOptions(
    _jvp_body, name="oh_jvp_exact_shapes", reduce_retracing=False,
    function_cache=_jvp_function_cache)
_jvp_relaxed = _tracing_compilation.TracingOptions(
    _jvp_body, name="oh_jvp_relaxed_shapes", reduce_retracing=True,
    function_cache=_jvp_function_cache)


def _tensorflow_jvp(execute, op, primals, tangents, outputs):
    """TensorFlow's own JVP: the transposed gradient function of the op."""
    if op.output_dtypes is None:
        # A function call (no OpDef). TensorFlow differentiates those through its function
        # machinery, which does not see handlers; replaying functions through handlers
        # is the functions issue. Never return a silently wrong (zero) tangent.
        raise NotImplementedError(
            "oh.ForwardAccumulator: op %s is a tf.function call with tangents on its "
            "inputs; forward mode through tf.function calls is not supported yet. Call "
            "the Python function without tf.function inside the accumulator."
            % op.type)
    filled = [t if t is not None or not _float(p) else _zeros(p)
              for p, t in zip(primals, tangents)]
    args = (op.gradient_type, op.attr_tuple(), list(primals), list(outputs), filled)
    try:
        result = None
        if any(isinstance(h, ForwardAccumulator) for h in current_stack().handlers):
            # An accumulator below must see the JVP op by op (higher order): run
            # TensorFlow's construction eagerly instead of as one traced function call.
            try:
                with _tapes_recording():
                    result = _tf_forwardprop._jvp_helper(  # pylint: disable=protected-access
                        *(args[:2] + (_more_rules.distinct(args[2]),) + args[3:]))
            except AssertionError:
                if tf.executing_eagerly():
                    raise
                # In a function being replayed some gradient functions fold shape
                # computations, which are no constants on the stacks (_SumGrad asserts):
                # the traced call then, which the accumulators below replay op by op.
        if result is None:
            # Traced once per op signature (exact shapes for the first 32 traces of an
            # op, as TensorFlow does, then relaxed shapes).
            traces = _tf_forwardprop._TRACE_COUNT.get(op.type, 0)  # pylint: disable=protected-access
            if len(_jvp_function_cache) >= _JVP_FUNCTIONS_MAX:
                _jvp_function_cache.clear()
            result = _tracing_compilation.call_function(
                args, tracing_options=_jvp_exact if traces < 32 else _jvp_relaxed)
    except LookupError as e:
        raise LookupError(
            "oh.ForwardAccumulator: op %s has no registered gradient, so no JVP (%s)"
            % (op.type, e)) from e
    # A transposed gradient can be a tf.IndexedSlices (the JVP of UnsortedSegmentSum is
    # a gather's gradient); tangents are tensors, as TensorFlow's C++ accumulator's.
    return [tf.convert_to_tensor(r) if isinstance(r, tf.IndexedSlices) else r
            for r in result]


_RULES["MaxPool"] = _more_rules.max_pool(_tensorflow_jvp)
_under_another = lambda acc: _more_rules.under_another(acc, ForwardAccumulator)  # noqa: E731


_UNSEEN_INPUT_WARNING = (
    "oh.ForwardAccumulator: a tf.GradientTape is recording, and a floating-point tensor "
    "(shape %s) that is neither a primal of this accumulator nor a variable entered it. "
    "TensorFlow's tape knows tensors by Python object and the accumulator only gets a new "
    "wrapper, so that tape treats it as a constant: its gradient of a JVP with respect to "
    "that tensor (or to what it was computed from) is None or partial. Make the tensor a "
    "primal with a zero tangent, or use oh.GradientTape for the outer tape (a constant "
    "warns too: the two cannot be told apart).")


def _recording(execute):
    """`execute`, recording each op on TensorFlow's tapes (for the JVP rules)."""
    def run(op, inputs):
        outputs = execute(op, inputs)
        if op.output_dtypes is not None:
            record_on_tf_tapes(op, inputs, outputs)
        return outputs
    return run


def _python_record(op_type, output_tensors, input_tensors, backward_function,
                   forward_function):
    """A gradient recorded from Python (`record.record_operation`): a tf.custom_gradient
    call reaches no handler hook as one op, only its inner ops do. TensorFlow's
    accumulators compute its JVP when it is recorded, with the forward function if one
    is given, else by transposing the backward function (the custom gradient function:
    an exception it raises reaches the caller); an output that already has a tangent
    (from the inner ops) keeps it. So does each recording accumulator of the scope."""
    if not _custom.has_jvp_to_compute(backward_function, forward_function):
        return  # (tf.function calls and copies: their ops reached the accumulator)
    if not tf.executing_eagerly():
        return  # (in a replayed function the node's gradient override is the op's)
    stack = current_stack()
    while stack.handler is not None:
        handler = stack.handler
        if isinstance(handler, ForwardAccumulator) and handler._live:  # pylint: disable=protected-access
            handler._record_python(stack.next, output_tensors, input_tensors,  # pylint: disable=protected-access
                                   backward_function, forward_function)
        stack = stack.next


subscribe_records(_python_record)


def _forget(accumulator_ref, key):
    """The callback dropping `key`'s entries when its watched tensor dies (it holds the
    accumulator weakly: no reference cycle through the accumulator's dicts)."""
    def forget(dead):
        acc = accumulator_ref()
        if acc is None:
            return
        for entries in (acc._watched, acc._objects):  # pylint: disable=protected-access
            entry = entries.get(key)
            ref = entry[0] if isinstance(entry, tuple) else entry
            if ref is dead:
                del entries[key]
    return forget


class ForwardAccumulator(OpHandler):
    """Computes Jacobian-vector products of the ops run in its scope (forward mode).

    The API is `tf.autodiff.ForwardAccumulator`'s: construct with `primals` and their
    `tangents` (nested structures; variables allowed), run the computation inside
    ``with acc:``, then ``acc.jvp(outputs)``.

    >>> v = tf.Variable([1.0, 2.0])
    >>> with oh.ForwardAccumulator(v, tf.constant([1.0, 0.0])) as acc:
    ...     y = tf.reduce_sum(v * v)
    >>> float(acc.jvp(y))
    2.0
    """

    transparent = True
    differentiates = "forward"  # read by handlers that treat forward mode specially
    TYPE_NAME = "FORWARD_ACCUMULATOR"

    def is_recording(self):
        return self._live

    def __init__(self, primals, tangents):
        nest.assert_same_structure(primals, tangents)
        self._watched = {}  # tensor key -> (weak reference to the primal, tangent)
        self._depth = 0
        self._live = False
        self._resumed = False  # recording again inside its own JVP computation
        self._traced = None
        self._watcher = None  # TensorFlow's variable watcher, while a tf tape is active
        self._objects = {}  # tensor key -> weak reference to the user's object (_canonical)
        if not tf.executing_eagerly():
            # Trace time (RFC "During tracing"): inside a function being traced the
            # accumulator is TensorFlow's own, which adds the JVP ops to the body.
            self._traced = tf.autodiff.ForwardAccumulator(primals, tangents)
            return
        seen = set()
        for primal in nest.flatten(primals):
            if id(primal) in seen:
                raise ValueError(
                    "oh.ForwardAccumulator: tensor %s was specified as a primal multiple "
                    "times; sum the corresponding tangents instead." % (primal,))
            seen.add(id(primal))
        nest.map_structure(self._watch, primals, tangents)

    def debug_string(self):
        return "ForwardAccumulator()"

    def _watch(self, primal, tangent):
        dtype = tf.as_dtype(primal.dtype)  # Keras variables give a string
        if not dtype.is_floating and not dtype.is_complex:
            _log.warning("oh.ForwardAccumulator: the dtype of the watched primal must be "
                         "floating (e.g. tf.float32), got %r", dtype)
        tangent = tf.convert_to_tensor(tangent, dtype=dtype.base_dtype)
        if not tangent.shape.is_compatible_with(primal.shape):
            raise ValueError("oh.ForwardAccumulator: tangent of shape %s for a primal of "
                             "shape %s" % (tangent.shape, primal.shape))
        if hasattr(primal, "handle"):
            primal = primal.handle  # a variable: its reads get the tangent
        found, value = representation_of(self, primal)
        if found:
            value.tangent = tangent if value.tangent is None else value.tangent + tangent
            return
        # A primal holding TensorFlow's cached handle of a Python scalar gets its own
        # first: that handle is shared by every equal scalar (two tf.constant(3.0)), and
        # a tape watching the tensor later would swap it away from under this key.
        own_handle(primal)
        key = _key(primal)
        old = self._watched.get(key)
        # Held weakly, as TensorFlow's accumulator does: a primal the program drops
        # takes its entry (and tangent) with it, so its key cannot be reused meanwhile.
        ref = self._weak(primal, key)
        self._watched[key] = (ref, tangent if old is None else old[1] + tangent)
        self._objects[key] = ref

    def _weak(self, tensor, key):
        """A weak reference to `tensor` whose death drops its entries here."""
        return weakref.ref(tensor, _forget(weakref.ref(self), key))

    # -- scopes ---------------------------------------------------------------------------

    def __enter__(self):
        if self._traced is not None:
            self._traced.__enter__()
            return self
        if self._live:
            raise ValueError("oh.ForwardAccumulator: the accumulator is already recording.")
        return super().__enter__()

    def __exit__(self, *exc_info):
        if self._traced is not None:
            return self._traced.__exit__(*exc_info)
        return super().__exit__(*exc_info)

    def scope_entered(self):
        self._depth += 1
        self._live = True
        if self._depth == 1 and not _tape_set_is_empty():
            # A TensorFlow tape around the accumulator (reverse over forward): variables
            # read in the scope are reported to watchers; see _canonical.
            self._watcher = pywrap_tfe.TFE_Py_VariableWatcherNew()

    def scope_exited(self):
        self._depth -= 1
        self._live = self._depth > 0
        if self._depth == 0 and self._watcher is not None:
            pywrap_tfe.TFE_Py_VariableWatcherRemove(self._watcher)
            self._watcher = None

    def _canonical(self, tensor):
        """The user's Python object for `tensor` (a new wrapper of a tensor that entered
        the accumulator), when a TensorFlow tape is active.

        TensorFlow's tapes key tensors by Python object; the tensors that enter the
        accumulator are new wrappers of the same TensorFlow handles. A tf.GradientTape
        around the accumulator differentiates the tangent ops only if they run on the
        objects it watches: the primals given to the accumulator and the variables read
        in its scope. (Any other tensor entering the accumulator is a leaf unseen by the
        tape; see "Composing autodiff" in docs/guide.md.)
        """
        key = _key(tensor)
        known = self._objects.get(key)
        if known is None and self._watcher is not None and _enum(tensor) == _RESOURCE:
            for v in pywrap_tfe.TFE_Py_VariableWatcherWatchedVariables(self._watcher):
                handle_key = _key(v.handle)
                if handle_key not in self._objects:
                    self._objects[handle_key] = self._weak(v.handle, handle_key)
            known = self._objects.get(key)
        known = None if known is None else known()
        return tensor if known is None else known

    # -- the handler ----------------------------------------------------------------------

    def static_value(self, value):
        return tf.get_static_value(value.primal)

    def device_string(self, value, stack):
        return value.primal.device

    def tensor_debug_string(self, value):
        from tensorflow.python.framework import ops  # pylint: disable=import-outside-toplevel
        return ops.value_text(value.primal)

    def copy_on(self, tensor):
        source = stack_of(tensor)
        below = next_stack()
        if source is not None and source.handler is self:  # ours from an earlier merge
            dual = source.unwrap(tensor)
            tangent = dual.tangent
            return Dual(below.copy_on(dual.primal),
                        None if tangent is None else below.copy_on(tangent))
        watched = self._watched.get(_key(tensor))
        tangent = None if watched is None else watched[1]
        if _tape_set_is_empty():
            return Dual(below.copy_on(tensor), tangent)
        known = self._canonical(tensor)  # reverse over forward: see _canonical
        # `tensor` is the dispatcher's new wrapper, not the user's object, so whether a
        # tf.GradientTape tracks the user's tensor cannot be asked here: a constant batch
        # warns too (once per process, see warn_once).
        if known is tensor and self._live and _enum(tensor) in _FLOAT_ENUMS and not (
                pywrap_tfe.TFE_Py_TapeSetIsStopped()) and not _custom.transposition_runs():
            errors.warn_once(("oh.ForwardAccumulator unseen input", tensor.dtype),
                             _UNSEEN_INPUT_WARNING % (tensor.shape,), stacklevel=2)
        tensor = known
        value = below.copy_on(tensor)
        if value is not tensor:
            record_on_tf_tapes(Op.cached("CopyOn", T=value.dtype), [tensor], [value])
        return Dual(value, tangent)

    def copy_off(self, value, device):
        return value.primal

    def handles_copy(self, op):
        # While recording, copies on this stack carry tangents (copies are linear).
        return self._live

    changes_computation = False  # runs each op as it is (and its JVP)

    def execute(self, op, inputs):
        below = next_stack()
        primals = [d.primal for d in inputs]
        if op.type == "EagerPyFunc" and self._live:
            # tf.py_function's kernel keeps the tape its gradient (and so its JVP) replays
            # only when a TensorFlow tape could record (script_ops.EagerFunc).
            with tf.GradientTape():
                outputs = below.execute(op, primals)
        else:
            outputs = below.execute(op, primals)
        run = below.execute
        if not _tape_set_is_empty() and op.output_dtypes is not None:
            # A TensorFlow tape around the accumulator (reverse over forward) must see the
            # ops on the primals and tangents (TensorFlow's tapes do not see the ops a
            # handler runs on the next stack): recorded here as oh.GradientTape does.
            record_on_tf_tapes(op, primals, outputs)
            run = _recording(below.execute)
        tangents = [d.tangent for d in inputs]
        if self._live and any(t is not None for t in tangents) and any(
                _enum(o) in _DIFFERENTIABLE_ENUMS for o in outputs):
            # (a tf.custom_gradient's node: its gradient transposed, as TensorFlow's)
            rule = (_RULES.get(op.type) if not op.gradient_op_type else None) or _tensorflow_jvp
            if rule in _REAL_ONLY and any(_enum(p) in _COMPLEX_ENUMS for p in primals):
                rule = _tensorflow_jvp  # the *Grad kernels conjugate complex values
            if self._resumed:
                # Resumed inside its own JVP computation (push_forwardprop_state): as
                # TensorFlow's, its JVPs there reach no tape created after it (the
                # transposing one).
                with _record.stop_recording():
                    out_tangents = rule(run, op, primals, tangents, outputs)
            else:
                out_tangents = rule(run, op, primals, tangents, outputs)
            if out_tangents is None:
                out_tangents = [None] * len(outputs)
            if len(out_tangents) != len(outputs):
                raise errors.HandlerError(
                    "oh.ForwardAccumulator: the JVP of op %s gave %d tangents for %d outputs"
                    % (op.type, len(out_tangents), len(outputs)))
            # Accumulators below see a JVP as TensorFlow's do (zeros, not None).
            out_tangents = _more_rules.connect_below(
                self, (ForwardAccumulator, Dual), primals, outputs, tangents, out_tangents,
                multilinear=rule is _multilinear)
        else:
            out_tangents = [None] * len(outputs)
        # Resource handles stay on the next stack (transient handler): a variable created
        # here must not keep the accumulator alive.
        results = [o if _enum(o) == _RESOURCE else Dual(o, t)
                   for o, t in zip(outputs, out_tangents)]
        if op.type in _FORWARDS_HANDLE and self._live:
            # A watched variable's handle passed on (a function's or a loop body's
            # Identity) keeps its tangent, as in TensorFlow's accumulator: its reads are
            # differentiated, and a loop variable keeps its representation (its primal
            # on the next stack, as the input's).
            for i, o in enumerate(outputs):
                if _enum(o) == _RESOURCE and inputs[i].tangent is not None:
                    results[i] = Dual(below.copy_on(o), inputs[i].tangent)
        return results

    def _tangent_of(self, tensor):
        """The tangent of `tensor` (a tensor of this stack or above, or a watched one)."""
        found, value = representation_of(self, tensor)
        if found:
            return getattr(value, "tangent", None)
        watched = self._watched.get(_key(tensor))
        return None if watched is None else watched[1]

    def _record_python(self, below, outputs, inputs, backward_function, forward_function):
        """The JVP of an operation recorded from Python (see _python_record): tangents
        of its outputs, tensors of `below` (the stack this accumulator executes on)."""
        tangents = [self._tangent_of(t) for t in inputs]
        if all(t is None for t in tangents):
            return
        duals = []
        for o in outputs:
            found, value = representation_of(self, o)
            duals.append(value if found and isinstance(value, Dual) else None)
        # Run in the scope of the record with the accumulator paused, as TensorFlow's
        # accumulator is while it runs the function: the function's ops (on the custom
        # gradient's closure, tensors of this stack) run on their primals, with no JVPs
        # of their own (accumulators below see them); a result is its primal.
        _custom.ensure_push_state_patch()
        self._live = False
        runs = _custom.transposition_runs()
        runs.append((self, current_stack(), len(state.frames)))
        try:
            with _tapes_recording():
                if forward_function is not None:
                    out_tangents = forward_function(*[
                        t if t is not None else _zeros(p) for t, p in zip(tangents, inputs)])
                else:
                    out_tangents = _custom.transposed(backward_function, outputs, tangents)
        finally:
            self._live = self._depth > 0
            runs.pop()
        for dual, tangent in zip(duals, out_tangents):
            if dual is not None and dual.tangent is None and tangent is not None:
                dual.tangent = self._below(tangent, below)

    def _resume_recording(self, resumed):
        """Records again (or stops) while transposing (custom_gradients.py)."""
        self._live = self._resumed = resumed

    def _below(self, tensor, below):
        """`tensor` (a result computed in the scope of a record) as a tensor of `below`."""
        found, value = representation_of(self, tensor)
        if found and isinstance(value, Dual):
            return value.primal
        return below.copy_on(tensor)

    # -- functions (core/functions) ---------------------------------------------------------

    def function_input(self, value):
        # A tangent crosses a function boundary as a second tensor.
        if value.tangent is None:
            return False, [value.primal]
        return True, [value.primal, value.tangent]

    def function_output(self, summary, tensors):
        return Dual(tensors[0], tensors[1] if summary else None)

    def function_join(self, summaries):
        return any(summaries)  # a tangent in one branch: zeros in the others

    def function_coerce(self, value, summary):
        if summary == "call" and (value.tangent is not None or not _float(value.primal)):
            return value  # (function_call_join: float arguments without a tangent)
        return Dual(value.primal, tf.zeros_like(value.primal)) if summary else value

    def function_call_join(self, summaries):
        # TensorFlow's JVP of a call gives zeros to the arguments without a tangent (an
        # HVP's gradient call), not inside nested JVPs (see under_another). Paused: none.
        return "call" if self._live and any(summaries) and not _under_another(self) else None

    def function_gradients_dense(self, summary):
        # As TensorFlow's: tangents on a call's arguments make its gradients dense (only
        # while the accumulator records: a paused one passes no input_tangents).
        return bool(summary) and self._live

    def function_cache_key(self):
        # The replay depends on the tangents' presence (the summaries), on whether the
        # accumulator records and function_call_join: later steps' accumulators share it.
        return ("ForwardAccumulator", self._live, _under_another(self))

    # -- results --------------------------------------------------------------------------

    def jvp(self, primals, unconnected_gradients=UnconnectedGradients.NONE):
        """The JVPs computed for `primals` (a structure of tensors or variables).

        Tangents are tensors of the stack the accumulator executed on (ordinary tensors
        unless it ran inside other handlers); None (or zeros with
        ``unconnected_gradients="zero"``) where no JVP was computed.
        """
        if self._traced is not None:
            return self._traced.jvp(primals, unconnected_gradients)
        return self._jvp(primals, unconnected_gradients)

    def _jvp(self, primals, unconnected_gradients):
        """`jvp` of an accumulator created eagerly."""
        unconnected = UnconnectedGradients(unconnected_gradients)

        def fetch(tensor):
            target = tensor.handle if hasattr(tensor, "handle") else tensor
            found, value = representation_of(self, target)
            if found:
                tangent = value.tangent
            else:
                watched = self._watched.get(_key(target))
                tangent = None if watched is None else watched[1]
            if tangent is None and unconnected is UnconnectedGradients.ZERO:
                tangent = tf.zeros_like(tensor)
            return tangent

        return nest.map_structure(fetch, primals)


_registries.register_tape("forward", ForwardAccumulator)
