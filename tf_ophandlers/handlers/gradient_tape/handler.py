"""`GradientTape`: reverse-mode autodiff as an op handler (the RFC's running example).

The tape's tensor representation is the tensor of the next stack (a tape changes no
values); its state is the tape. Every op placed on the tape runs on the next stack and,
when one of its inputs is watched or derived from a watched tensor, is recorded with the
stack it ran on. `gradient` walks the records backward and runs each op's gradient
function from TensorFlow's gradient registry on the stack of its forward op (RFC
"Re-entering a merged handler stack, gradient function placement"), so tapes nest with
each other, with `tf.GradientTape` (in either order) and with every other handler.

>>> import tensorflow as tf, tf_ophandlers as oh
>>> x = tf.constant(3.0)
>>> with oh.GradientTape() as tape:
...     tape.watch(x)
...     y = x * x
>>> float(tape.gradient(y, x))
6.0

The API is `tf.GradientTape`'s: `persistent`, `watch_accessed_variables`, `watch`,
`watched_variables`, `gradient` (nested targets and sources, `output_gradients`,
`unconnected_gradients`), `stop_recording`, `reset`, `jacobian`, `batch_jacobian`.
"""
import contextlib
import logging
import weakref

import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import backprop as _tf_backprop
from tensorflow.python.eager import backprop_util
from tensorflow.python.framework import composite_tensor_gradient
from tensorflow.python.framework import ops as _ops
from tensorflow.python.ops.unconnected_gradients import UnconnectedGradients
from tensorflow.python.util import nest

from tf_ophandlers.extend import (
    COPY_OPS, copy_through, current_stack, next_stack, Op, OpHandler, own_handle, PHYSICAL,
    record_on_tf_tapes, recording, registries as _registries, representation_of,
    run_deferred_above, scope as _scope, SOURCE_GRADIENT_NODE, stack_of, state, tensor_key,
    tf_patches)
from tf_ophandlers.handlers.gradient_tape import hooks as gradient_tape_hooks
from tf_ophandlers.handlers.gradient_tape.backward import BackwardPass, check_differentiable
from tf_ophandlers.handlers.gradient_tape.exclusions import (
    drop_unread, track_ref, tracked_entry, used_indices)

_log = logging.getLogger("tf_ophandlers")
_EagerTensor = _ops.EagerTensor
_key = tensor_key  # tensors are keyed by TensorFlow handle (see PyTensorKey in cc/boundary/module.cc)
_tape_set_is_stopped = pywrap_tfe.TFE_Py_TapeSetIsStopped
_tape_set_is_empty = pywrap_tfe.TFE_Py_TapeSetIsEmpty

_RESOURCE = tf.resource.as_datatype_enum
_OPAQUE_ENUMS = (_RESOURCE, tf.variant.as_datatype_enum)
UID_SHIFT = 20  # a recorded output's id: (record seq << UID_SHIFT) | output index

# Ops that read a variable: a read of a variable not yet watched asks the watcher first.
_VARIABLE_READS = frozenset(("ReadVariableOp", "ResourceGather", "ResourceGatherNd"))



# Differentiable dtypes (backprop_util.IsTrainable), as enums: cheaper than tensor.dtype.
_TRAINABLE_ENUMS = frozenset(
    d.as_datatype_enum for d in (tf.float16, tf.bfloat16, tf.float32, tf.float64,
                                 tf.complex64, tf.complex128, tf.resource, tf.variant)
    if backprop_util.IsTrainable(d))


# One recorded operation: a C type (cc/handlers/gradient_tape/tape_record.h, also the memory contract: as
# TensorFlow's tape, a record keeps only the inputs and outputs its op's gradient reads,
# exclusions.py) with read-only seq, op_type, op, backward, inputs,
# outputs, stack (where its gradient runs), skip and ids (the graph's links).
_Record, _after_execute_c = recording(_TRAINABLE_ENUMS, used_indices)
_SWEEP_MIN = 1024  # `_tracked` sizes that never ask for a sweep (cc/handlers/gradient_tape/tape_record.cc kSweepMin)


def _active_tapes():
    """The recording oh.GradientTapes of this thread's current scope, innermost first."""
    if _tape_set_is_stopped():
        return ()
    return tuple(h for h in reversed(current_stack().handlers)
                 if isinstance(h, GradientTape) and h._live)  # pylint: disable=protected-access


def recording_tapes():
    """The recording oh.GradientTapes of the current stack, innermost first (inside a
    hook: the tapes below the running handler)."""
    return _active_tapes()


class GradientTape(BackwardPass, OpHandler):
    """Records operations for automatic differentiation (`tf.GradientTape` as a handler).

    Operations are recorded if they run inside the tape's scope and at least one of
    their inputs is watched (`watch`, or a trainable variable read inside the scope) or
    was computed from a watched tensor. Gradient functions come from TensorFlow's
    registry (`tf.RegisterGradient`, `tf.custom_gradient`, `tf.recompute_grad`).

    >>> v = tf.Variable(2.0)
    >>> with oh.GradientTape() as tape:
    ...     loss = (v - 5.0) ** 2
    >>> float(tape.gradient(loss, v))
    -6.0
    """

    transparent = True  # tensor.device shows the physical device, as with tf.GradientTape
    # A function call is recorded whole, with TensorFlow's function gradient (its
    # forward and backward functions), not replayed op by op.
    replays_functions = False
    differentiates = "reverse"  # read by handlers that treat a recording tape specially
    defers_needs_copy = True  # inputs a handler below takes as they are stay as they are
    TYPE_NAME = "GRADIENT_TAPE"

    def __init__(self, persistent=False, watch_accessed_variables=True):
        self._persistent = persistent
        self._watch_accessed_variables = watch_accessed_variables
        self._depth = 0  # open scopes of this tape
        self._paused = 0  # stop_recording() scopes
        self._used = False  # a non-persistent tape after its one gradient call
        self._stopped = False  # a non-persistent tape asked for gradients in its scope
        self._live = False  # recording: inside a scope, not paused, stopped or used
        self._watcher = None  # TensorFlow's variable watcher while a scope is open
        self._vectorizing = False  # inside jacobian's oh.vectorized_map
        self._traced = None  # TensorFlow's tape, while the scope is open in a trace
        self._clear()

    def _update_live(self):
        self._live = (self._depth > 0 and not self._paused and not self._used
                      and not self._stopped)

    def _clear(self):
        self._producer = {}  # output id -> _Record that produced it
        # _key(tensor) -> (tensor, id) for watched tensors, (weakref or tensor, id) for
        # recorded outputs (see tracked_entry)
        self._tracked = {}
        self._sweep_at = _SWEEP_MIN  # `_tracked`'s size at which dead entries are dropped
        self._variables = {}  # _key(handle) -> variable watched
        self._seq = 0
        self._watch_ids = 0  # watched tensors' ids: -1, -2, ...

    def debug_string(self):
        return "GradientTape(persistent=%s)" % self._persistent

    # -- scopes ---------------------------------------------------------------------------

    def __enter__(self):
        if self._live:
            raise ValueError("oh.GradientTape: Tape is still recording, This can happen if "
                             "you try to re-enter an already-active tape.")
        if not tf.executing_eagerly():
            # Trace time (RFC "During tracing"): opened inside a function being traced,
            # the tape is TensorFlow's own, which adds the gradient ops to the function
            # body; the handler is not involved once the trace is complete.
            self._traced = tf.GradientTape(self._persistent, self._watch_accessed_variables)
            self._traced.__enter__()
            self._watch_eager_on_traced()
            return self
        self._traced = None
        return super().__enter__()

    def _watch_eager_on_traced(self):
        """A tape created eagerly and re-entered in a function being traced keeps
        watching the tensors and variables it watched eagerly, as tf.GradientTape does
        (its tape is the same object): TensorFlow links an eager tensor to the
        function's capture of it, so ops on the capture are recorded."""
        watched = [t for t, uid in self._tracked.values()
                   if uid < 0 and type(t) is _EagerTensor and t.dtype != tf.resource
                   and stack_of(t) is None]
        watched.extend(self._variables.values())
        if watched:
            self._traced.watch(watched)

    def __exit__(self, *exc_info):
        if self._traced is not None:
            return self._traced.__exit__(*exc_info)
        if not _scope.is_open(self):
            return False  # a second __exit__: tolerated, as tf.GradientTape does
        return super().__exit__(*exc_info)

    def scope_entered(self):
        tf_patches.ensure("tape hooks")
        if self._depth == 0:
            if self._used:
                self._clear()  # as tf.GradientTape: re-entering starts a fresh tape
                self._used = False
            self._stopped = False
        self._depth += 1
        self._update_live()
        if self._depth == 1 and self._watch_accessed_variables:
            # TensorFlow reports every trainable variable read (from Python, and from
            # the C++ fast path that reads variables passed straight to an op) to its
            # variable watchers; the tape watches what its watcher saw.
            self._watcher = pywrap_tfe.TFE_Py_VariableWatcherNew()

    def values_released(self):
        # Outside its scopes the tape's results are plain tensors (as tf.GradientTape's):
        # later ops run below it, so results of two tapes combine (OpHandler.values_released).
        return self._depth == 0

    def scope_exited(self):
        self._depth -= 1
        self._update_live()
        if self._depth == 0 and self._watcher is not None:
            self._harvest_variables()
            pywrap_tfe.TFE_Py_VariableWatcherRemove(self._watcher)
            self._watcher = None

    def _harvest_variables(self):
        """Watches the trainable variables read since the scope opened."""
        if self._watcher is None or self._used:
            return False
        known = self._variables
        new = [v for v in pywrap_tfe.TFE_Py_VariableWatcherWatchedVariables(self._watcher)
               if _key(v.handle) not in known]
        for v in new:
            self._watch_variable(v)
        return bool(new)

    def stop_recording(self):
        """Temporarily stops recording operations on this tape (as tf.GradientTape)."""
        if self._traced is not None:
            return self._traced.stop_recording()
        return self._stop_recording()

    @contextlib.contextmanager
    def _stop_recording(self):
        if not self._live:
            raise RuntimeError("oh.GradientTape: trying to stop recording a tape which is "
                               "not recording.")
        # Ops a handler above deferred (oh.Lazy) run before the pause, as recorded ops, and
        # those deferred inside it before the tape resumes.
        run_deferred_above(self)
        self._paused += 1
        self._update_live()
        try:
            yield
        finally:
            try:
                run_deferred_above(self)
            finally:
                self._paused -= 1
                self._update_live()

    def reset(self):
        """Clears everything recorded; recording continues if inside the tape's scope."""
        if self._traced is not None:
            return self._traced.reset()
        self._clear()
        self._used = False
        self._stopped = False
        self._update_live()
        if self._watcher is not None:
            # The variables read before the reset are forgotten too (TensorFlow's reset
            # starts a new tape, which watches the variables read from then on).
            pywrap_tfe.TFE_Py_VariableWatcherRemove(self._watcher)
            self._watcher = pywrap_tfe.TFE_Py_VariableWatcherNew()

    # -- the handler ----------------------------------------------------------------------

    changes_computation = False  # runs each op as it is and records it

    def execute(self, op, inputs):
        # The Python path. For ordinary ops the C++ fast path runs the op on the next
        # stack itself and calls only after_execute (OpHandler.after_execute).
        below = next_stack()
        if op.type == "EagerPyFunc" and self._live:
            # tf.py_function's kernel keeps the tape its gradient replays only when a
            # TensorFlow tape could record (script_ops.EagerFunc); an empty one says so.
            with tf.GradientTape():
                outputs = below.execute(op, inputs)
        else:
            outputs = below.execute(op, inputs)
        if self._live:
            self.after_execute(op, list(inputs), list(outputs))
        return outputs

    # Records `op` when one of its inputs is tracked (watched, or computed from a watched
    # tensor) and an output is differentiable: in C (cc/handlers/gradient_tape/tape_record.h), which hands the
    # cases it does not take to _after_execute_python, the same in Python.
    after_execute = _after_execute_c

    def _after_execute_python(self, op, inputs, outputs):
        """after_execute in Python (the reference of cc/handlers/gradient_tape/tape_record.cc). `inputs` and
        `outputs` are lists the tape keeps."""
        if not self._live:
            return
        # TensorFlow hands us a new Python wrapper of a tensor at each use; the record
        # keeps the object the tape saw first (the user's, for watched tensors), so
        # gradient functions and tf.GradientTapes (which key by Python object) see one
        # tensor.
        tracked = self._tracked
        found = False
        skip = []
        in_ids = []
        for i, t in enumerate(inputs):
            known = tracked_entry(tracked, t)
            if known is None:
                skip.append(i)
                in_ids.append(None)
            else:
                inputs[i], uid = known
                in_ids.append(uid)
                found = True
        if not found:
            if op.type not in _VARIABLE_READS or not self._harvest_variables():
                return
            return self._after_execute_python(op, inputs, outputs)  # a variable read just now
        if _tape_set_is_stopped():
            return
        op_type = op.type
        trainable = [o for o in outputs if o._datatype_enum() in _TRAINABLE_ENUMS]  # pylint: disable=protected-access
        if not trainable:
            return
        if op_type in COPY_OPS:
            # A copy that returned its input (an identity copy on a physical device)
            # made no new tensor: recording it would make the tensor its own producer.
            same = {_key(t) for t in inputs}
            trainable = [o for o in trainable if _key(o) not in same]
            if not trainable:
                return
        self._new_record(op_type, op, None, inputs, outputs, next_stack(), tuple(skip),
                         in_ids, trainable)
        if not _tape_set_is_empty():
            self._bridge_to_tf_tapes(op, inputs, outputs)

    def _new_record(self, op_type, op, backward, inputs, outputs, stack, skip, in_ids,
                    trainable):
        """Appends a record; `trainable` (outputs) become tracked."""
        self._seq += 1
        seq = self._seq
        base = seq << UID_SHIFT
        out_ids = tuple(base | j for j in range(len(outputs)))
        kept_in, kept_out, specs = inputs, outputs, None
        if backward is None and op is not None and _tape_set_is_empty():
            kept_in, kept_out, specs = drop_unread(op_type, inputs, outputs)
        elif backward is not None and _tape_set_is_empty() and \
                _registries.gradient_accepts_none(op_type) is _registries.ALL_OUTPUTS:
            # A backward function that takes None for every output gradient reads none
            # of the outputs (their zeros are never made): holding them would keep, say,
            # a recomputed segment's outputs alive through its own backward call, as
            # TensorFlow's tape, which keeps only the outputs' shapes, does not.
            kept_out = [None if type(o) is _EagerTensor and o._datatype_enum() not in  # pylint: disable=protected-access
                        _OPAQUE_ENUMS else o for o in outputs]
            # Nor its tracked inputs: its backward function holds what it reads of them
            # (TensorFlow's tape keeps none), and a segment's may hold less (oh.Recompute
            # drops checkpoints it computes again).
            kept_in = [None if i is not None and type(x) is _EagerTensor
                       and x._datatype_enum() not in _OPAQUE_ENUMS else x  # pylint: disable=protected-access
                       for x, i in zip(inputs, in_ids)]
        record = _Record(seq, op_type, op, backward, kept_in, kept_out, stack, skip,
                         (tuple(in_ids), out_ids, specs))
        tracked, producer = self._tracked, self._producer
        trainable = {id(o) for o in trainable}
        for j, o in enumerate(outputs):
            if id(o) in trainable:
                tracked[_key(o)] = (track_ref(o), out_ids[j])
                producer[out_ids[j]] = record
        if len(tracked) >= max(self._sweep_at, _SWEEP_MIN):
            self._sweep_tracked()
        return record

    def _sweep_tracked(self):
        """Drops the `_tracked` entries of recorded outputs that are gone (their records
        stay, linked by id): without it a long persistent tape's `_tracked` grows by
        every output it ever recorded. The next sweep waits until the size doubles, so
        the cost per record stays O(1)."""
        tracked = self._tracked
        dead = [k for k, (ref, _) in tracked.items()
                if type(ref) is weakref.ref and ref() is None]  # pylint: disable=unidiomatic-typecheck
        for k in dead:
            del tracked[k]
        self._sweep_at = max(_SWEEP_MIN, 2 * len(tracked))

    def is_recording(self):
        return self._live

    def handles_copy(self, op):
        # While recording, copy ops on the tape's stack are recorded like other ops and
        # their outputs stay on the tape (a tape's copies are identities), so enclosing
        # tapes can differentiate through them: the gradient of CopyOn is CopyOnGrad.
        return self._live

    def copy_on(self, tensor):
        # The default move, recorded when it creates a new tensor from a tracked one, so
        # gradients flow back through CopyOnGrad (RFC "Copies and their gradients").
        source = stack_of(tensor)
        if source is not None and source.handler is self:
            tensor = source.unwrap(tensor)  # our tensor from an earlier merge
        below = self.next
        value = below.copy_on(tensor)
        known = tracked_entry(self._tracked, tensor)
        if (known is None and self._watcher is not None
                and tensor._datatype_enum() == _RESOURCE and self._harvest_variables()):  # pylint: disable=protected-access
            known = tracked_entry(self._tracked, tensor)  # a variable handle read just now
        # (Recorded while TensorFlow stopped recording too: a call's arguments are
        # copied down the stacks while its forward function runs, and a tape below may
        # record the replay of the call on the copies.)
        if known is not None and _key(value) != _key(tensor) and self._live:
            tensor = known[0]
            op = Op.cached("CopyOn", T=value.dtype)
            self._record("CopyOn", op, None, [tensor], [value], below, ())
            self._bridge_to_tf_tapes(op, [tensor], [value])
        return value

    def _record(self, op_type, op, backward, inputs, outputs, stack, skip):
        """Appends a record if an output is differentiable; returns whether it did.
        `inputs` are the tape's canonical tensors (or untracked ones)."""
        trainable = [o for o in outputs
                     if o is not None and o._datatype_enum() in _TRAINABLE_ENUMS]  # pylint: disable=protected-access
        if not trainable:
            return False
        if op_type in COPY_OPS:
            # A copy that returned its input (an identity copy on a physical device) made
            # no new tensor: recording it would make the tensor its own producer.
            same = {_key(t) for t in inputs}
            trainable = [o for o in trainable if _key(o) not in same]
            if not trainable:
                return False
        tracked = self._tracked
        in_ids = []
        for t in inputs:
            known = tracked_entry(tracked, t)
            in_ids.append(None if known is None else known[1])
        self._new_record(op_type, op, backward, list(inputs), list(outputs), stack, skip,
                         in_ids, trainable)
        return True

    def record_sum(self, parts, total):
        """Records `total = AddN(parts)`, computed on the physical devices by a tape
        nested in this one (see BackwardPass._record_on_enclosing_tapes), if a part is
        tracked here."""
        tracked = self._tracked
        known = [tracked_entry(tracked, p) for p in parts]
        canonical = [p if k is None else k[0] for p, k in zip(parts, known)]
        skip = tuple(i for i, k in enumerate(known) if k is None)
        if len(skip) < len(parts) and not _tape_set_is_stopped():
            op = Op.cached("AddN", N=len(parts), T=total.dtype)
            self._record("AddN", op, None, canonical, [total], PHYSICAL, skip)

    # When a tf.GradientTape (or ForwardAccumulator) is active, it must also see the ops
    # on our representations, which our gradient functions use (cc/handlers/gradient_tape/tape_record.cc calls
    # it by this name).
    _bridge_to_tf_tapes = staticmethod(record_on_tf_tapes)

    # -- tensors at this tape's level -----------------------------------------------------

    def _recorded_ops(self):
        """The oh.Ops this tape recorded, in order (handlers/substitutes.py asks whether
        a handler's hook ran just the op it got)."""
        records = {id(r): r for r in self._producer.values()}
        return [r.op for r in sorted(records.values(), key=lambda r: r.seq)]

    def _level_of(self, tensor):
        """`tensor` as this tape sees it: its representation if it lives on a stack of
        this tape (looking through tensor-valued handlers above it), else itself."""
        return representation_of(self, tensor)[1]

    def watch(self, tensor):
        """Ensures that `tensor` (tensors, variables, or nested structures) is traced."""
        if self._traced is not None:
            return self._traced.watch(tensor)
        for t in _tf_backprop._extract_tensors_and_variables(tensor):  # pylint: disable=protected-access
            if not backprop_util.IsTrainable(t):
                _log.warning("oh.GradientTape.watch: the dtype of the watched tensor must be "
                             "floating (e.g. tf.float32), got %r", t.dtype)
                continue
            if hasattr(t, "handle"):
                self._watch_variable(t)
            else:
                value = self._level_of(t)
                if value is t:
                    # Equal Python scalars share one TensorFlow handle: the watched one
                    # gets its own, so that its twins are not watched with it.
                    own_handle(t)
                self._track_watched(value)

    def _watch_variable(self, variable):
        handle = variable.handle
        self._track_watched(self._level_of(handle))
        self._variables.setdefault(_key(handle), variable)

    def _targets_at_level(self, targets):
        """The targets as this tape sees them, the ops that make that view recorded even
        if the tape no longer records (scope closed, non-persistent tape stopped): a
        handler above may compute it (oh.DataFormat transposes its channels-last value
        back), and an unrecorded view is unconnected (a None gradient)."""
        self._live = not self._used
        try:
            return [self._level_of(t) for t in targets]
        finally:
            self._update_live()

    def _track_watched(self, value):
        if tracked_entry(self._tracked, value) is None:
            self._watch_ids -= 1
            self._tracked[_key(value)] = (value, self._watch_ids)

    def _id_of(self, tensor):
        """The id a tensor at this tape's level has in records (its key if untracked)."""
        known = tracked_entry(self._tracked, tensor)
        return ("untracked", _key(tensor)) if known is None else known[1]

    def watched_variables(self):
        """Variables watched by this tape, in order of construction."""
        if self._traced is not None:
            return self._traced.watched_variables()
        self._harvest_variables()
        variables = list(self._variables.values())
        return tuple(sorted(variables, key=lambda v: getattr(v, "_unique_id", 0)))

    # -- gradients ------------------------------------------------------------------------

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=UnconnectedGradients.NONE):
        """Gradients of `target` with respect to `sources` (see tf.GradientTape.gradient).

        Returns the structure of `sources` with a tensor (or IndexedSlices, or None) for
        each; the gradients live where the sources do.
        """
        if self._traced is not None:
            return self._traced.gradient(target, sources, output_gradients,
                                         unconnected_gradients)
        # The checks and conversions are helpers so that this frame stays at a small
        # bytecode offset while the gradient ops run (see vectorized_map's comment:
        # TensorFlow scans each frame's line table per eager op).
        args = self._gradient_arguments(target, sources, output_gradients)
        # A non-persistent tape asked after its scope closed (the usual step) frees
        # each record once its gradient ran (inside the scope a failed call may be
        # retried, so the records stay until it succeeds).
        flat_grads = self._backprop(*args, unconnected_gradients,
                                    release=not self._persistent and self._depth == 0)
        flat_grads = _like_sources(args[1], flat_grads)
        return self._gradient_result(sources, args[3], flat_grads)

    def _gradient_arguments(self, target, sources, output_gradients):
        """gradient's checked, flattened (targets, sources, output gradients, sources as
        given)."""
        self._check_usable()
        if target is None:
            raise TypeError("oh.GradientTape.gradient: argument `target` should be a list or "
                            "nested structure of Tensors, Variables or CompositeTensors to "
                            "be differentiated, but received None.")
        check_differentiable("gradient", "target", target)
        check_differentiable("gradient", "sources", sources)
        flat_targets = composite_tensor_gradient.get_flat_tensors_for_gradients(
            nest.flatten(target))
        flat_targets = [_tf_backprop._handle_or_self(t) for t in flat_targets]  # pylint: disable=protected-access
        # Before a non-persistent tape stops: the view is a value request for handlers
        # inside the tape (oh.Recompute records what computed it now).
        flat_targets = self._targets_at_level(flat_targets)
        self._stop_if_non_persistent_in_scope()
        flat_sources_raw = nest.flatten(sources)
        flat_sources = composite_tensor_gradient.get_flat_tensors_for_gradients(
            [_tf_backprop._handle_or_self(t) for t in flat_sources_raw])  # pylint: disable=protected-access
        if output_gradients is not None:
            from tensorflow.python.util import variable_utils  # pylint: disable=import-outside-toplevel
            output_gradients = composite_tensor_gradient.get_flat_tensors_for_gradients(
                nest.flatten(variable_utils.convert_variables_to_tensors(output_gradients)))
            output_gradients = [None if g is None else _ops.convert_to_tensor(g)
                                for g in output_gradients]
            if len(output_gradients) != len(flat_targets):
                raise ValueError("oh.GradientTape.gradient: got %d output_gradients for %d "
                                 "targets" % (len(output_gradients), len(flat_targets)))
        return flat_targets, flat_sources, output_gradients, flat_sources_raw

    def _gradient_result(self, sources, flat_sources_raw, flat_grads):
        self._release_if_non_persistent()
        flat_sources_raw = [_tf_backprop._handle_or_self(s) for s in flat_sources_raw]  # pylint: disable=protected-access
        flat_grads = composite_tensor_gradient.replace_flat_tensors_for_gradients(
            flat_sources_raw, flat_grads)
        return nest.pack_sequence_as(sources, flat_grads)

    def _check_usable(self):
        if self._used:
            raise RuntimeError("oh.GradientTape: A non-persistent GradientTape can only be "
                               "used to compute one set of gradients (or jacobians)")

    def _stop_if_non_persistent_in_scope(self):
        if self._live and not self._persistent:
            # As tf.GradientTape: a non-persistent tape stops recording when asked for
            # gradients inside its scope; a persistent one records the gradient ops too
            # (for higher-order gradients). A failed gradient call may be retried.
            self._stopped = True
            self._update_live()

    def _release_if_non_persistent(self):
        if not self._persistent:
            self._used = True
            self._update_live()
            variables = self._variables
            self._clear()  # free what was recorded once gradients are computed
            self._variables = variables


copy_through(GradientTape.copy_on)  # its untracked inputs skip it in C (recording.py)


# -- integration with TensorFlow's Python-level tape hooks --------------------------------
#
# Gradients recorded from Python (custom gradients, tf.function calls) reach the
# oh.GradientTapes of the current scope through gradient_tape_hooks' patches.
gradient_tape_hooks.register(_active_tapes)


def _marked_in_function(sources, grads):
    """While a function is traced in the scope of a handler with `source_gradient`, each
    dense gradient as the first output of IdentityN(gradient, source) named
    `SOURCE_GRADIENT_NODE`: the sources are placeholders now, so the handler can only
    give the gradient its source's representation when it replays the function and
    meets the node (other handlers, and TensorFlow, run it as the identity it is)."""
    if state.mode is not None or not any(
            h.source_gradient is not None for h in getattr(current_stack(), "handlers", ())):
        return grads
    out = list(grads)
    for i, (source, g) in enumerate(zip(sources, grads)):
        # (A variable's source is its eager handle, captured by the node as by its reads.)
        if (isinstance(g, tf.Tensor) and not isinstance(g, _EagerTensor)
                and isinstance(source, tf.Tensor)):
            out[i] = tf.raw_ops.IdentityN(input=[g, source], name=SOURCE_GRADIENT_NODE)[0]
    return out


def _like_sources(sources, grads):
    """Each dense gradient (of oh.GradientTape, and of tf.GradientTape through the
    "source gradients" patch) as the handlers of its source's stack represent it
    (`OpHandler.source_gradient`: oh.Mesh gives it the source's layout)."""
    if grads and not any(isinstance(g, _EagerTensor) for g in grads):
        return _marked_in_function(sources, grads)
    out = list(grads)
    for i, (source, g) in enumerate(zip(sources, grads)):
        if g is None or not isinstance(g, _EagerTensor):
            continue  # IndexedSlices, unconnected sources, symbolic tensors
        stack = stack_of(source)
        if stack is None:
            continue
        for h in stack.handlers:
            if h.source_gradient is not None:
                out[i] = h.source_gradient(source, out[i])
    return out


def _wrap_imperative_grad(original):
    def imperative_grad(tape, target, sources, *args, **kwargs):
        return _like_sources(sources, original(tape, target, sources, *args, **kwargs))

    imperative_grad.__doc__ = original.__doc__
    return imperative_grad


# Traced in the scope of a handler with a source_gradient hook, each dense gradient is
# marked as IdentityN(gradient, source) for the handler's replay.
tf_patches.subscribe("imperative_grad.imperative_grad", "source gradients",
                     _wrap_imperative_grad)


_registries.register_tape("reverse", GradientTape)
