"""The backward pass of `oh.GradientTape`: gradient functions from TensorFlow's registry
run over the recorded ops in reverse, each on the stack its forward op ran on (RFC:
gradient ops are placed where the forward op ran); `jacobian` and `batch_jacobian`
backpropagate one seed per target element, vectorized with `oh.vectorized_map` over the
seeds when every recorded op ran on physical devices (as tf.GradientTape's pfor), else one
backward pass per seed. A mixin of `GradientTape` (recording lives in handler.py),
so that each module reads in one sitting; argument checks shared by both are here too.
"""
import contextlib

import numpy as np
import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import backprop as _tf_backprop
from tensorflow.python.eager import context as _context
from tensorflow.python.framework import ops as _ops
from tensorflow.python.framework.composite_tensor import CompositeTensor
from tensorflow.python.ops import default_gradient
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.ops.unconnected_gradients import UnconnectedGradients
from tensorflow.python.util import nest

from tf_ophandlers.extend import (
    BoundedCache, current_stack, PHYSICAL, registries as _registries, scope as _scope,
    stack_of, state as _state, tensor_key, warn_once)
from tf_ophandlers.handlers.gradient_tape.static_gradients import STATIC_GRADIENTS

_key = tensor_key
_stack_of = stack_of
# TensorFlow's gradient registry's dict (name -> {"type": function, ...}), read before its
# `lookup` (which converts the name and raises the LookupError reported below).
_registered = getattr(_ops._gradient_registry, "_registry", {})  # pylint: disable=protected-access


# (dtype enum, static shape, device) -> a physical tensor of ones, for _seed.
_seed_ones = BoundedCache("gradient_tape.seed_ones", 256)


def _seed(target):
    """The default output gradient (ones) of a target on the stack of a handler with
    ``constant_seeds = True`` (oh.vectorized_map: a constant entering its stack is an
    unbatched value, what `ones_like` there gives) and a static shape: a cached ones
    tensor copied onto that stack, instead of a Shape and a Fill through TensorFlow's
    wrappers and the handler. None otherwise (the caller runs `ones_like`)."""
    stack = _stack_of(target)
    if stack is None or not getattr(stack.handler, "constant_seeds", False) or (
            target.dtype == tf.string):
        return None
    shape = target.shape
    if not shape.is_fully_defined() or not tf.executing_eagerly():
        return None
    dtype = target.dtype
    with _scope.physical():
        key = (dtype.as_datatype_enum, tuple(shape.as_list()),
               _context.context().device_name)
        ones = _seed_ones.get(key)
        if ones is None:
            ones = _seed_ones[key] = tf.ones(shape, dtype)
    return stack.copy_on(ones)


UNTRACKED_INPUT_WARNING = (
    "oh.GradientTape: a tf.GradientTape is recording this gradient computation, and op "
    "%s on its path has a floating-point input this tape does not track (%s). TensorFlow's "
    "tape knows tensors by Python object and sees only the new wrapper a handler gets, so "
    "it treats that input as a constant: its gradient of this gradient misses the input's "
    "dependence on the tensors it watches (None or partial, where nested tf.GradientTapes "
    "give a value). Watch the tensor on this tape too (tape.watch), or use oh.GradientTape "
    "for the outer tape.")


def _warn_untracked_inputs(path):
    """Warns when an enclosing tf.GradientTape would silently miss a dependence: a
    recorded op on the backward path with an untracked floating-point input. (A
    constant warns too: the tape cannot tell it from a tensor the outer tape derived
    from its watched ones.)"""
    if pywrap_tfe.TFE_Py_TapeSetIsStopped():
        return
    for record in path:
        for i in record.skip:
            x = record.inputs[i]
            if x is not None and getattr(x, "dtype", None) is not None and (
                    x.dtype.is_floating or x.dtype.is_complex):
                warn_once(("oh.GradientTape untracked input", record.op_type, i),
                          UNTRACKED_INPUT_WARNING % (
                              record.op_type, "input %d, shape %s" % (i, x.shape)),
                          stacklevel=4)
                return


def _variable_zeros(handle):
    """Zeros of the variable `handle` (a call's resource output without a gradient) when
    its handle data has no shape, else None. TensorFlow's backward function of the call
    fills None with zeros of that shape: oh.vectorized_map's pfor functions give their
    resource placeholders a dtype only (ValueError "Cannot convert a partially known
    TensorShape", OH_FUZZ_SEED=128 slow case 13)."""
    data = resource_variable_ops.get_eager_safe_handle_data(handle)
    if data is None or not data.is_set or len(data.shape_and_type) != 1:
        return None
    shape_and_type = data.shape_and_type[0]
    if tf.TensorShape(shape_and_type.shape).is_fully_defined():
        return None
    try:
        shape = tf.raw_ops.VariableShape(input=handle)
    except (tf.errors.OpError, TypeError, ValueError):
        return None
    return tf.zeros(shape, tf.as_dtype(shape_and_type.dtype))


def _zeros_of(spec):
    """Zeros of a dropped output's (dtype enum, dims)."""
    dtype = tf.dtypes.as_dtype(spec[0])
    if dtype in (tf.string, tf.resource):
        return None
    return tf.zeros(spec[1], dtype)


def differentiable_value(value):
    """Whether `value` is something a tape differentiates: a tensor, a variable (also a
    Keras one) or a composite tensor."""
    return (tf.is_tensor(value) or isinstance(value, (tf.Variable, CompositeTensor))
            or resource_variable_ops.is_resource_variable(value))


def check_differentiable(method, argument, structure):
    """Raises for a value in `structure` that is not a tensor, as tf.GradientTape does
    (same exception types: AttributeError for numpy values and Python ints, TypeError for
    other objects), instead of returning a silent None."""
    for i, value in enumerate(nest.flatten(structure)):
        if differentiable_value(value):
            continue
        error = (AttributeError if isinstance(value, (np.ndarray, np.generic, int))
                 else TypeError)
        raise error(
            "oh.GradientTape.%s: argument `%s` should be a Tensor, Variable or "
            "CompositeTensor (or a nested structure of them), but element %d is %s of type "
            "%s; convert it with tf.constant (and watch it) before computing the value to "
            "differentiate." % (method, argument, i, short_repr(value),
                                type(value).__name__))


def short_repr(value):
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _LazyAttrsOp(_tf_backprop._MockOp):  # pylint: disable=protected-access
    """TensorFlow's `_MockOp` whose attribute tuple is made when a gradient function
    first reads it (`get_attr`): making it serializes the recorded op's attributes, and
    most gradient functions read none (relu, add, the copies, reshape)."""

    def __init__(self, op, inputs, outputs, typ, skip_input_indices):  # pylint: disable=super-init-not-called
        # (_MockOp.__init__ sets these and `attrs`, which __getattr__ makes instead)
        self._op = op
        self.inputs = inputs
        self.outputs = outputs
        self.type = typ
        self.skip_input_indices = skip_input_indices

    def __getattr__(self, name):
        if name != "attrs":
            raise AttributeError(name)
        self.attrs = attrs = self._op.attr_tuple()  # (later reads: the instance's)
        return attrs


def _registered_gradient(record):
    """(gradient function, static-shape rule or None, _MockOp) of a record without
    `backward`, or None when its op has no gradient (tf.no_gradient).

    A node's gradient override (tf.custom_gradient in a replayed function) replaces its
    type's gradient, as in TensorFlow's graph gradients; the same lookup as
    oh.ForwardAccumulator's (a record without `backward` has its Op)."""
    op = record.op  # (its gradient_type property, inlined: per record)
    gradient_type = op.gradient_op_type or op.type
    # Registry.lookup's own dict first (a str key: no compat.as_str frames per record).
    entry = _registered.get(gradient_type) if type(gradient_type) is str else None
    try:
        grad_fn = (entry["type"] if type(entry) is dict and "type" in entry
                   else _ops._gradient_registry.lookup(gradient_type))  # pylint: disable=protected-access
    except LookupError as e:
        raise LookupError(
            "oh.GradientTape: op %s has no registered gradient (%s); register one "
            "with tf.RegisterGradient or stop it with tf.stop_gradient"
            % (record.op_type, e)) from e
    if grad_fn is None:
        return None
    mock = _LazyAttrsOp(record.op, record.inputs, record.outputs, record.op_type,
                        record.skip)
    static = STATIC_GRADIENTS.get(gradient_type)
    if static is not None and not getattr(record.stack.handler, "static_shape_gradients",
                                          False):
        static = None
    return grad_fn, static, mock


def _take_parts(record, grads, source_ids):
    """The gradient parts of `record`'s outputs (None if none has any), taken out of
    `grads` (except for sources, whose gradients are results)."""
    out_ids = record.ids[1]
    parts = list(map(grads.get, out_ids))  # (no comprehension frame: per record)
    if not any(parts):
        return None
    for i in out_ids:
        if i not in source_ids:
            grads.pop(i, None)
    return parts


class BackwardPass:
    """The backward pass, `jacobian` and `batch_jacobian` of `oh.GradientTape`."""

    def _backprop(self, targets, sources, output_gradients, sources_raw, unconnected,
                  release=False):
        """The gradients of `targets` with respect to `sources`. With `release` (a
        non-persistent tape's single backward pass) each record is dropped once its
        gradient function ran, as TensorFlow's tape erases its entries, so the values
        it saved are freed during the backward pass instead of after it."""
        # Split in helpers so that the frames on the stack while gradient functions run
        # stay at small bytecode offsets: TensorFlow captures the line numbers of up to
        # 30 Python frames per eager op (TFE_Py_FastPathExecute), each by a scan of the
        # frame's line table up to its current instruction.
        try:
            unconnected = UnconnectedGradients(unconnected)
        except ValueError:
            raise ValueError("oh.GradientTape: Unknown value for unconnected_gradients: "
                             "%r" % (unconnected,)) from None
        path, grads, live, source_list, source_ids = self._backward_path(
            targets, sources, output_gradients)
        if release:
            # The tape's own maps hold every record and recorded tensor: emptied now
            # (the tape cannot be used again), so `path` holds the records alone.
            self._release_records()
            while path:
                self._run_backward(path.pop(), grads, live, source_ids)
        else:
            for record in reversed(path):
                self._run_backward(record, grads, live, source_ids)
        return self._source_gradients(grads, source_list, sources_raw, unconnected)

    def _backward_path(self, targets, sources, output_gradients):
        """The records on a path from a source to a target (in recording order), the
        targets' seed gradients by id, the ids reached from the sources, and the
        sources' ids (a list and a set)."""
        targets = self._targets_at_level(targets)
        sources = [self._level_of(s) for s in sources]
        producer = self._producer
        # Tensors are known by their ids in records (GradientTape._id_of).
        target_ids = [self._id_of(t) for t in targets]
        source_list = [self._id_of(s) for s in sources]
        source_ids = set(source_list)

        # Records on a path from a source to a target, in recording order.
        needed, pending, seen = {}, list(target_ids), {None}
        while pending:
            i = pending.pop()
            if i in seen:
                continue
            seen.add(i)
            record = producer.get(i)
            if record is not None and record.seq not in needed:
                needed[record.seq] = record
                pending.extend(record.ids[0])  # (None ids: skipped as seen below)
        live = set(source_ids)
        path = []
        for seq in sorted(needed):  # (loops, not generators: per record)
            record = needed[seq]
            for x in record.ids[0]:
                if x in live:
                    path.append(record)
                    live.update(record.ids[1])
                    break

        if not pywrap_tfe.TFE_Py_TapeSetIsEmpty():
            _warn_untracked_inputs(path)

        grads = {}
        for i, (t, tid) in enumerate(zip(targets, target_ids)):
            if tid not in live:
                continue
            g = output_gradients[i] if output_gradients is not None else None
            if g is None:
                g = _seed(t)
                if g is None:
                    g = self._ones_like(t)
                    if g is None:
                        continue  # a string target has no gradient (TensorFlow: None)
            grads.setdefault(tid, []).append(g)
        return path, grads, live, source_list, source_ids

    def _release_records(self):
        variables = self._variables
        self._clear()
        self._variables = variables
        self._used = True

    def _source_gradients(self, grads, source_list, sources_raw, unconnected):
        result = []
        for sid, raw in zip(source_list, sources_raw):
            parts = grads.get(sid)
            if parts:
                with self._where(parts[0]):
                    total = _tf_backprop._aggregate_grads(parts)  # pylint: disable=protected-access
                if len(parts) > 1 and _stack_of(total) is None:
                    self._record_on_enclosing_tapes(parts, total)
                result.append(total)
            elif unconnected is UnconnectedGradients.ZERO:
                result.append(default_gradient.zeros_like(raw))
            else:
                result.append(None)
        return result

    def _ones_like(self, t):
        if t.dtype == tf.string:
            return None  # as TensorFlow's tape seeds a string target (backprop._ones)
        with self._where(t):
            return default_gradient.ones_like(t)

    def _record_on_enclosing_tapes(self, parts, total):
        """Records the sum of a source's gradient parts computed on the physical devices
        on the tapes recording around this one. The parts of a physical source used
        twice arrive off the stack (CopyOnGrad), and `_where` sums them on the physical
        devices, where the enclosing oh.GradientTapes do not see the AddN: their
        gradient of this gradient was None. (tf.GradientTapes record it themselves.)"""
        if not isinstance(total, tf.Tensor) or any(
                not isinstance(p, tf.Tensor) for p in parts):
            return  # IndexedSlices parts are concatenated, not summed with an op
        for handler in current_stack().handlers:
            if handler is not self and getattr(handler, "_live", False) and hasattr(
                    handler, "record_sum"):
                handler.record_sum(parts, total)

    def _run_backward(self, record, grads, live, source_ids):
        parts = _take_parts(record, grads, source_ids)
        if parts is None:
            return
        stack = record.stack  # (placed there already: no _entered frame)
        scope = None if stack is _state.current else self._entered(stack)
        if scope is None:  # (no `with` of a null context per record)
            in_grads = self._call_gradient_function(record, *self._summed(record, parts))
        else:
            with scope:
                in_grads = self._call_gradient_function(
                    record, *self._summed(record, parts))
        for i, g in zip(record.ids[0], in_grads):
            if g is not None and i is not None and i in live:
                grads.setdefault(i, []).append(g)

    @classmethod
    def _summed(cls, record, parts):
        """(output gradients, which outputs had no part), emptying `parts`: the parts
        of an output used more than once are freed once summed, before its gradient
        function runs, as TensorFlow's tape frees them (its AggregateGradients takes
        their references), not held beside the sum through that call."""
        missing = frozenset(k for k, p in enumerate(parts) if not p)
        out_grads = cls._output_gradients(record, parts)
        parts.clear()
        return out_grads, missing

    @staticmethod
    def _output_gradients(record, parts):
        """The gradient of each output of `record`: the sum of its `parts`, else None or
        zeros as its gradient function takes them."""
        specs = record.ids[2]
        accepts_none = _registries.gradient_accepts_none(record.op_type)
        out_grads = []
        for k, (o, p) in enumerate(zip(record.outputs, parts)):
            if p:
                out_grads.append(p[0] if len(p) == 1 else _tf_backprop._aggregate_grads(p))  # pylint: disable=protected-access
            elif k in accepts_none:
                out_grads.append(None)
            elif specs is not None and specs[k] is not None:
                # an output the tape dropped (its gradient function does not read it)
                out_grads.append(_zeros_of(specs[k]))
            elif o is None or o.dtype in (tf.string, tf.resource):
                out_grads.append(_variable_zeros(o) if record.backward is not None and
                                 o is not None and o.dtype == tf.resource else None)
            else:
                out_grads.append(default_gradient.zeros_like(o))
        return out_grads

    def _call_gradient_function(self, record, out_grads, missing=frozenset()):
        """`missing`: the outputs that had no gradient part, for a backward reading
        which were missing."""
        if record.backward is not None:
            if getattr(record.backward, "reads_missing", False):
                # (a replayed call with tangents: which outputs had no gradient, before
                # the zeros filled in; core/functions/call_records.densified)
                in_grads = record.backward(*out_grads, missing=missing)
            else:
                in_grads = record.backward(*out_grads)
        else:
            found = _registered_gradient(record)
            if found is None:  # tf.no_gradient / ops.NotDifferentiable
                return [None] * len(record.inputs)
            grad_fn, static, mock = found
            in_grads = None
            if static is not None:
                in_grads = static(mock, *out_grads)  # None: not on static shapes
            if in_grads is None:
                in_grads = grad_fn(mock, *out_grads)
        if not isinstance(in_grads, (list, tuple)):
            in_grads = [in_grads]
        if len(in_grads) != len(record.inputs):
            # TensorFlow's tape says "too few" for too many too; same type and text.
            raise tf.errors.InternalError(
                None, None,
                "oh.GradientTape: Recorded operation '%s' returned too few gradients. "
                "Expected %d but received %d" % (
                    record.op_type, len(record.inputs), len(in_grads)))
        return in_grads

    def _where(self, tensor):
        """Runs ops where `tensor` lives: its stack, or the physical devices for an
        ordinary tensor (not the ambient scope: a parallel handler around would
        broadcast it), except inside this tape's own vectorized jacobian."""
        stack = _stack_of(tensor)
        if stack is not None:
            return self._placed(stack)
        if current_stack() is PHYSICAL or self._vectorizing:
            return contextlib.nullcontext()
        return _scope.physical()

    @staticmethod
    def _placed(stack):
        """Runs gradient ops on `stack` (entered within the current scope, per the RFC)."""
        scope = BackwardPass._entered(stack)
        return contextlib.nullcontext() if scope is None else scope

    @staticmethod
    def _entered(stack):
        """The scope that places ops on `stack`, or None when they are placed there
        already (re-entering would open nothing)."""
        current = _state.current  # (current_stack(), inlined: once per record)
        if stack is current:
            return None
        # (loops, not all/any of generators: this runs for every record)
        handlers = current.handlers
        for h in stack.handlers:
            for c in handlers:
                if h is c:
                    break
            else:
                return _scope.handler(stack)
        return None

    # -- jacobians (a loop of backward passes; vectorized with oh.vectorized_map) -----------

    def jacobian(self, target, sources, unconnected_gradients=UnconnectedGradients.NONE,
                 parallel_iterations=None, experimental_use_pfor=True):
        """The Jacobian of `target` with respect to each of `sources`.

        Each result has shape ``target.shape + source.shape``. One backward pass over the
        recording, vectorized over the rows with `oh.vectorized_map` (with
        ``experimental_use_pfor=False``, or when a recorded op ran under another handler,
        one backward pass per row). A non-persistent tape allows it, as
        tf.GradientTape's default does.
        """
        if self._traced is not None:
            return self._traced.jacobian(target, sources, unconnected_gradients,
                                         parallel_iterations, experimental_use_pfor)
        del parallel_iterations
        self._check_usable()
        if not hasattr(target, "shape"):  # tf.GradientTape reads target.shape
            raise AttributeError(
                "oh.GradientTape.jacobian: argument `target` should be a Tensor, but "
                "received %s of type %s." % (short_repr(target), type(target).__name__))
        check_differentiable("jacobian", "sources", sources)
        self._stop_if_non_persistent_in_scope()
        flat_sources = nest.flatten(sources)
        target = _ops.convert_to_tensor(target)
        size = target.shape.num_elements()
        if size is None:
            raise ValueError("oh.GradientTape.jacobian: the target needs a static shape, "
                             "got %s" % target.shape)
        with self._where(target):
            seeds = tf.reshape(tf.eye(size, dtype=target.dtype), [size] + target.shape.as_list())
        rows = self._backprop_rows(target, flat_sources, seeds, unconnected_gradients,
                                   experimental_use_pfor)
        self._release_if_non_persistent()
        out = []
        for source, g in zip(flat_sources, rows):
            out.append(None if g is None else
                       tf.reshape(g, target.shape.concatenate(source.shape)))
        return nest.pack_sequence_as(sources, out)

    def batch_jacobian(self, target, source, unconnected_gradients=UnconnectedGradients.NONE,
                       parallel_iterations=None, experimental_use_pfor=True):
        """Per-example Jacobians: result ``[b, y1, ..., yn, x1, ..., xm]``.

        `target[i, ...]` must depend only on `source[i, ...]` (as for tf.GradientTape).
        Vectorized over the target's per-example elements, as `jacobian`.
        """
        if self._traced is not None:
            return self._traced.batch_jacobian(target, source, unconnected_gradients,
                                               parallel_iterations, experimental_use_pfor)
        del parallel_iterations
        self._check_usable()
        for argument, value in (("target", target), ("source", source)):
            if not hasattr(value, "shape"):  # tf.GradientTape reads their shapes
                raise AttributeError(
                    "oh.GradientTape.batch_jacobian: argument `%s` should be a Tensor, "
                    "but received %s of type %s." % (argument, short_repr(value),
                                                     type(value).__name__))
        check_differentiable("batch_jacobian", "source", source)
        t_shape, s_shape = tf.TensorShape(target.shape), tf.TensorShape(source.shape)
        for argument, shape in (("target", t_shape), ("source", s_shape)):
            if shape.rank is not None and shape.rank < 2:
                # tf.GradientTape's message (TensorShape.with_rank_at_least).
                raise ValueError(
                    "oh.GradientTape.batch_jacobian: Shape %s must have rank at least 2 "
                    "(the %s is [batch, ...])" % (shape, argument))
        self._stop_if_non_persistent_in_scope()
        target = _ops.convert_to_tensor(target)
        if (t_shape.rank is None or s_shape.rank is None
                or not t_shape[:1].is_compatible_with(s_shape[:1])):
            raise ValueError("oh.GradientTape: Need first dimension of target shape (%s) "
                             "and source shape (%s) to match." % (t_shape, s_shape))
        if not t_shape.is_fully_defined():
            raise ValueError("oh.GradientTape.batch_jacobian: the target needs a static "
                             "shape, got %s" % t_shape)
        batch = int(t_shape[0])
        row = t_shape.num_elements() // batch
        with self._where(target):
            seeds = tf.reshape(tf.tile(tf.eye(row, dtype=target.dtype)[:, None, :],
                                       [1, batch, 1]), [row] + t_shape.as_list())
        (g,) = self._backprop_rows(target, [source], seeds, unconnected_gradients,
                                   experimental_use_pfor)
        self._release_if_non_persistent()
        if g is None:
            # As tf.GradientTape: zeros (of the target's dtype), whatever
            # unconnected_gradients says.
            return tf.zeros(t_shape.concatenate(s_shape[1:]), target.dtype)
        out = tf.experimental.numpy.moveaxis(g, 0, 1)  # [b, row, x...]
        return tf.reshape(out, t_shape.concatenate(s_shape[1:]))

    def _backprop_rows(self, target, sources, seeds, unconnected, use_pfor):
        """For each source, the gradients for every seed, stacked: [len(seeds), ...]."""
        handles = [_tf_backprop._handle_or_self(s) for s in sources]  # pylint: disable=protected-access

        def one(seed):
            grads = self._backprop([target], handles, [seed], sources, unconnected)
            return [None if g is None else _ops.convert_to_tensor(g) for g in grads]

        vectorized_map = _registries.vectorizer()
        if use_pfor and vectorized_map is not None and all(
                r.stack is PHYSICAL for r in self._producer.values()):
            self._vectorizing = True
            try:
                return vectorized_map(one, seeds)
            finally:
                self._vectorizing = False
        rows = [one(seeds[i]) for i in range(int(seeds.shape[0]))]
        if not rows:
            # No rows (a target without elements): an empty stack of rows, as
            # tf.GradientTape's loop gives (of the target's dtype).
            return [tf.zeros([0] + tf.TensorShape(source.shape).as_list(), target.dtype)
                    for source in sources]
        out = []
        for j, source in enumerate(sources):
            col = [r[j] for r in rows]
            if all(g is None for g in col):
                out.append(None)
            else:
                out.append(tf.stack([tf.zeros_like(source) if g is None else g for g in col]))
        return out
