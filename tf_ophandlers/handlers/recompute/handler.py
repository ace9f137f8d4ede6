"""`Recompute`: automatic gradient checkpointing as an op handler (the RFC's first
motivation: "gradient checkpointing requires recursively recomputing").

>>> import tensorflow as tf, tf_ophandlers as oh
>>> ws = [tf.Variable(tf.random.normal([64, 64]) * 0.1) for _ in range(32)]
>>> x = tf.random.normal([256, 64])
>>> with oh.GradientTape() as tape:
...     with oh.Recompute():                 # policy="sqrt": about sqrt(n) segments
...         h = x
...         for w in ws:
...             h = tf.tanh(h @ w)
...         loss = tf.reduce_sum(h * h)
>>> grads = tape.gradient(loss, ws)          # equal to tf.GradientTape's

Opened inside a tape's scope, the handler runs each op eagerly on the stack below it with
the tapes paused, and groups the recomputable ops it ran (stateless ops with a tracked
input and a differentiable output) into *segments*. Each segment is recorded on the tapes
as one operation (segments.py) whose inputs are kept and whose gradient
recomputes the segment, so the values inside a segment are freed as soon as the program
drops them instead of being held by the tape until the backward pass. A segment whose
outputs are also used inside it (values the program keeps) is recorded as several
operations, so a gradient with respect to such a value sees all its uses (equal to
tf.GradientTape's; recompute_segments.split).

Opened inside a function being traced (graph mode), the scope puts the recompute
structure into the traced graph instead (graph.py), as it does for a function
traced inside an eager scope (a Keras fit step). An eager scope inside a recording
tf.GradientTape cannot save anything (that tape records the ops itself): it warns.

Ops that must not be recomputed run as they are and the tape records them itself:
stateful ops (random ops with hidden state, variable reads and updates, prints),
ops on resources or variants. A tf.function called in the scope while only handler tapes
record runs as a segmented rewrite of its forward function (calls.py); other
calls are kept whole. Their outputs are kept, so a variable read
sees the value of the forward pass even if the variable changes before the backward pass.

Policies (where segments end):

- ``policy="sqrt"`` (default): a segment ends once the bytes it computed reach
  sqrt(total bytes x mean value bytes): about sqrt(n) segments of sqrt(n) values (Chen et
  al.). The total is the one seen so far, or the previous scope's when the handler is
  reused across steps (then the segments are the optimal ones from the second step).
  On a program with joins (residual adds) segments end at joins, where one value is
  live.
- ``save=("MatMul", "Conv2D", ...)``: a segment ends after each op of these types, so
  their outputs are kept and only the ops between them are recomputed (JAX's
  ``checkpoint_dots``, PyTorch's selective activation checkpointing).
- ``memory_budget=bytes``: keeps the estimated activation memory (kept values plus the
  largest segment) under the budget, recomputing the cheapest tensors first. Cost model
  (`EXPENSIVE_OPS`): outputs of contractions and convolutions (MatMul, BatchMatMul,
  Einsum, Conv2D, ...) are expensive per byte, every other op's cheap. The plan divides
  the computation (in the order it runs) into up to three parts: a first part
  recomputed whole in sqrt(n) segments (only when the budget is too small otherwise), a
  *selective* part where the outputs of expensive ops are kept and the cheap ops between
  them recomputed (partial segments: each saves its expensive ops' outputs, and its
  gradient function takes them and recomputes the rest in one graph-speed call), and a last part recorded as kept segments
  (nothing recomputed; their gradient function takes their saved values at graph
  speed). More budget first shrinks the part that recomputes expensive ops, then grows
  the kept part. The plan needs the computation's size and its expensive share: the
  first scope of a handler runs the sqrt policy and measures them; reuse the handler
  (``with rc:`` per step). A budget below the minimum of every plan
  (``rc.minimum_budget()``) raises ValueError naming both.
"""
import math
import os
import sys
import warnings
import weakref

import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import record as _record
from tensorflow.python.framework import op_def_registry
from tensorflow.python.ops import gradients_util

from tf_ophandlers.extend import BoundedCache, COPY_OPS, HandlerError, never_copy, OpHandler
from tf_ophandlers.handlers.recompute import (
    calls as recompute_calls, evict as recompute_evict, graph as recompute_graph,
    thinning as recompute_thinning)
from tf_ophandlers.handlers.recompute.evict import Value as _Value, described as _described
from tf_ophandlers.handlers.recompute.evict import tensor_of as _tensor_of
from tf_ophandlers.handlers.recompute.graph import Window
from tf_ophandlers.handlers.recompute.segments import Segment, nbytes, record

_stateful = BoundedCache("recompute.stateful_ops", 4096)  # op type -> must not recompute
_NOT_RECOMPUTED = frozenset(("EagerPyFunc", "PyFunc", "PyFuncStateless", "Print", "PrintV2"))
_TRAINABLE = frozenset(d.as_datatype_enum for d in (
    tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.complex64, tf.complex128))
_MARGIN = 0.9  # share of a memory budget planned for the estimated activations
# Values (held values, checkpoints) below this many bytes are not worth dropping.
_MIN_DROP_BYTES = 4096
_WORKING = 4  # values of the largest size the backward pass holds besides them
_OPAQUE = frozenset((tf.resource.as_datatype_enum, tf.variant.as_datatype_enum))
# The cost model of the budget policy: outputs of contractions and convolutions cost
# O(contraction size) flops per byte to recompute, every other op (elementwise,
# reductions, reshapes, gathers) O(1); a budget keeps the expensive ones first.
EXPENSIVE_OPS = frozenset((
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "Conv",
    "Conv1D", "Conv2D", "Conv3D", "DepthwiseConv2dNative", "Conv2DBackpropInput",
    "Conv3DBackpropInputV2", "_FusedMatMul", "_FusedConv2D", "SparseMatMul",
    "SparseTensorDenseMatMul", "TensorDot"))
_GRID = 200  # plans tried by the budget planner (fractions of the computation)


def _is_stateful(op_type):
    s = _stateful.get(op_type)
    if s is None:
        op_def = op_def_registry.get(op_type)
        s = _stateful[op_type] = (op_def is None or op_def.is_stateful
                                  or op_type in _NOT_RECOMPUTED or op_type in COPY_OPS)
    return s


def _user_stacklevel():
    """The warnings stacklevel of the first frame outside this package (the user's)."""
    package = os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    frame, level = sys._getframe(1), 2  # pylint: disable=protected-access
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2  # (entered from C++: no user frame)


def _is_join(inputs, outputs):
    """Whether an op joins two full-size values (a residual add): at most its output is
    live after it, where a chain of single-input ops leaves one value too, but a
    segment ending inside a residual block keeps the block's input besides."""
    if len(outputs) != 1 or len(inputs) < 2:
        return False
    shape = outputs[0].shape
    if not shape.is_fully_defined() or shape.num_elements() < 1024:
        return False
    full = 0
    for v in inputs:
        if type(v) is _Value and (v.segment is not None or v.tracked) \
                and _described(v).shape == shape:
            full += 1
    return full >= 2


def _trainable(tensor):
    return tensor.dtype.as_datatype_enum in _TRAINABLE


class Recompute(OpHandler):
    """Gradient checkpointing for the tapes it is opened in (see the module docstring).

    Use it inside a tape's scope: ``with oh.GradientTape() as tape: with
    oh.Recompute(): loss = model(x)``; then ``tape.gradient`` outside the Recompute scope.

    Examples:
        >>> w = tf.Variable([[0.5]])
        >>> with oh.GradientTape() as tape:
        ...     with oh.Recompute():
        ...         loss = tf.reduce_sum(tf.tanh(tf.tanh(tf.ones([1, 1]) @ w)))
        >>> with tf.GradientTape() as ref:
        ...     want = tf.reduce_sum(tf.tanh(tf.tanh(tf.ones([1, 1]) @ w)))
        >>> float(tape.gradient(loss, w)[0, 0]) == float(ref.gradient(want, w)[0, 0])
        True
    """

    TYPE_NAME = "RECOMPUTE"
    one_thread_at_a_time = True  # its open scope's segments and statistics are on self
    # What may be recomputed (also used by recompute_graph.Window).
    is_stateful_type = staticmethod(_is_stateful)
    is_trainable = staticmethod(_trainable)
    transparent = True
    replays_functions = False  # calls reach execute whole (calls.py)
    changes_computation = False  # runs each op as it is (again in the backward pass)

    def __init__(self, policy="sqrt", save=None, memory_budget=None):
        given = [name for name, v in (("save", save), ("memory_budget", memory_budget))
                 if v is not None]
        if len(given) > 1:
            raise ValueError("oh.Recompute: give at most one of save= and memory_budget=, "
                             "got %s" % " and ".join(given))
        if given:
            policy = given[0]
        elif policy != "sqrt":
            raise ValueError("oh.Recompute: unknown policy %r; use policy=\"sqrt\", "
                             "save=(op types...) or memory_budget=bytes" % (policy,))
        if save is not None:
            if isinstance(save, str) or not all(isinstance(s, str) for s in save):
                raise TypeError("oh.Recompute: save= must be a tuple of op type names "
                                "(e.g. (\"MatMul\", \"Conv2D\")), got %r" % (save,))
            unknown = [s for s in save if op_def_registry.get(s) is None]
            if unknown:
                raise ValueError("oh.Recompute: save= names unknown op types %s"
                                 % ", ".join(unknown))
            save = frozenset(save)
        if memory_budget is not None:
            if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) \
                    or memory_budget <= 0:
                raise ValueError("oh.Recompute: memory_budget= must be a positive number "
                                 "of bytes, got %r" % (memory_budget,))
        self.policy = policy
        self.save = save
        self.memory_budget = memory_budget
        # Values below this many bytes are never dropped (evict.py); None
        # turns eviction off.
        self.evict_min_bytes = _MIN_DROP_BYTES
        # Checkpoint thinning (thinning.py, sqrt policy): the extra forward computation
        # the backward pass may spend recomputing dropped checkpoints, as a share of the
        # bytes the segments computed; 0 keeps every checkpoint.
        self.checkpoint_thinning = 0.25
        # The sqrt policy on a program with joins (residual adds): a segment ends at the
        # first join after it computed this share of sqrt(total x mean value bytes), or
        # at `join_cap` times sqrt(total x mean value bytes) without one.
        self.join_fraction = 0.5
        self.join_cap = 2.0
        # The gradient functions run their ops one at a time, in the order they were made
        # (segments.run_in_order): a lower, steadier peak for less parallelism.
        self.in_order = False
        self._joins = False
        self._windows = []  # per open scope: a Window (traced), None (traced, no tape), False
        self._open = None  # the segment receiving nodes
        # (segment, node): the open segment ends after the next op if it maps that join
        # node's output (_run_in_segment), else before it.
        self._join_end = None
        self._pending = []  # closed segments not recorded yet (recorded at flush)
        self._lagging = None  # the last segment closed, its values not dropped yet
        self._depth = 0
        self._below = self._tf_tape = self._as_is = self._warned_forward = None
        self._computed = 0  # bytes of values computed by segments in this scope
        self._count = 0  # values computed by segments in this scope
        self._thinned = self._thinned_bytes = 0  # checkpoints dropped (thinning.py)
        self._kept = 0  # bytes kept by the tapes (segment outputs) in this scope
        self._largest = 0  # bytes of the largest segment in this scope
        # Of the last scope: (total bytes, mean and largest value bytes, bytes of
        # expensive ops' outputs, largest run of cheap bytes between expensive ops, bytes
        # of the variables read: their gradients).
        self._expected = None
        self._regions = (0.0, 0.0)  # budget plan: bytes ending the sqrt, selective parts
        self.segments = 0  # segments recorded (all scopes)
        # Of the last scope: dict(computed, kept, largest, segments, recomputed: op type ->
        # ops the gradient functions recompute).
        self.stats = None
        # Of the last scope opened while tracing, or traced inside an eager scope (a Keras
        # fit step): the same keys, computed from static shapes (unknown dimensions as 1).
        self.graph_stats = None

    def debug_string(self):
        if self.policy == "save":
            return "Recompute(save=%s)" % (tuple(sorted(self.save)),)
        if self.policy == "memory_budget":
            return "Recompute(memory_budget=%d)" % self.memory_budget
        return "Recompute()"

    # -- scopes ---------------------------------------------------------------------------

    def __enter__(self):
        if not tf.executing_eagerly():
            # Inside a function being traced the tapes are TensorFlow's own (trace time):
            # the scope collects their records and records segments at its exit
            # (graph.py); without a recording tape there is nothing to do.
            window = Window(self) if _record.could_possibly_record() else None
            self._windows.append(window)
            if window is not None:
                window.__enter__()
            self.stats = None
            return self
        self._windows.append(False)
        return super().__enter__()

    def __exit__(self, *exc_info):
        window = self._windows.pop() if self._windows else False
        if window is False:
            return super().__exit__(*exc_info)
        if window is not None:
            window.__exit__(*exc_info)
            self.stats = self.graph_stats
        return False

    def scope_entered(self):
        self._depth += 1
        if self._depth == 1:
            recompute_graph.eager_scope(self)
            self.graph_stats = None
            # A tf.GradientTape records the ops of this scope itself, on the tensors the
            # program sees, after they return from the handler: it keeps every
            # activation whatever the handler does (only oh.GradientTape, below the
            # handler, records what it gives it). Said, not silently ignored.
            self._tf_tape = not pywrap_tfe.TFE_Py_TapeSetIsEmpty()
            self._below = None  # _as_is follows _tf_tape
            if self._tf_tape:
                warnings.warn(
                    "oh.Recompute: a tf.GradientTape is recording around this scope; it "
                    "records every op of the scope itself and keeps its activations, so "
                    "nothing is saved (gradients are unchanged). Use oh.GradientTape "
                    "around oh.Recompute() (or open the scope inside a tf.function, "
                    "where tf.GradientTape works).", RuntimeWarning,
                    stacklevel=_user_stacklevel())
            self._computed = self._count = self._kept = self._largest = 0
            self._largest_value = 0
            self._expensive = self._run = self._max_run = 0
            self._recomputed = {}
            self._variables, self._params = {}, 0
            self._segments_at_entry = self.segments
            self._calls = self._call_segments = 0  # tf.function calls run as rewrites
            self._evicted = self._remat_ops = 0  # bytes dropped, ops rerun (eviction)
            self._thinned = self._thinned_bytes = 0  # checkpoints dropped (thinning)
            self._threshold_cache = None
            self._joins = False  # a join (residual add) seen in this scope
            if self.policy == "memory_budget" and self._expected is not None:
                self._plan_budget()

    def scope_exited(self):
        self._depth -= 1
        if self._depth == 0:
            recompute_graph.eager_scope(None)
            self.flush()
            if self._count:
                self._expected = (self._computed, self._computed / self._count,
                                  self._largest_value, self._expensive,
                                  max(self._max_run, self._run), self._params,
                                  self._joins)
            self._variables = {}
            self.stats = dict(computed=self._computed, kept=self._kept,
                              largest=self._largest,
                              segments=self.segments - self._segments_at_entry,
                              recomputed=dict(self._recomputed), mode="eager",
                              graph=self.graph_stats, tf_tape_recording=self._tf_tape,
                              calls=self._calls, call_segments=self._call_segments,
                              evicted=self._evicted, rematerialized=self._remat_ops,
                              thinned=self._thinned, thinned_bytes=self._thinned_bytes)
            if self.policy == "memory_budget" and self._count:
                minimum = self.minimum_budget()
                if self.memory_budget < minimum:
                    raise ValueError(
                        "oh.Recompute: memory_budget=%d bytes is below the minimum "
                        "feasible for this computation, about %d bytes (%d bytes of "
                        "activations, recomputed in sqrt(n) segments)" % (
                            self.memory_budget, minimum, self._computed))

    def minimum_budget(self):
        """The smallest activation memory of any budget plan for the last scope's
        computation (bytes; at most sqrt(n) segments' 2 * sqrt(total bytes * mean value
        bytes)), plus the backward pass's working values and a margin, as budgets are
        planned. None before a scope ran."""
        if self._expected is None:
            return None
        largest = self._expected[2]
        need = min(self._need(f / _GRID, 1 - f / _GRID) for f in range(_GRID + 1))
        return int(math.ceil((need + _WORKING * largest + self._expected[5]) / _MARGIN))

    def _need(self, f, s):
        """Estimated activation bytes of the plan recomputing the first `f` of the
        computation whole (sqrt(n) segments), the next `s` selectively (expensive ops'
        outputs kept, the cheap ops between them recomputed) and keeping the rest."""
        total, mean, _, expensive = self._expected[:4]
        cap = self._selective_cap()
        kept_share = min(1.0, expensive / max(total, 1) + mean / cap)
        checkpoints = math.sqrt(f * total * mean) if f > 0 else 0.0
        segment = max(checkpoints, cap + mean if s > 0 else 0.0)
        return checkpoints + segment + s * total * kept_share + max(0.0, 1 - f - s) * total

    def _selective_cap(self):
        total, mean = self._expected[:2]
        return max(mean, math.sqrt(total * mean), 1.0)

    def _plan_budget(self):
        """Chooses the parts (see the module docstring): the smallest part recomputing
        expensive ops, then the smallest selective part, whose estimate plus the
        backward pass's working values fits the budget."""
        total, mean, largest = self._expected[:3]
        # What the estimate leaves out (the backward pass's gradients in flight, the
        # tape's own references) comes off the budget first.
        budget = self.memory_budget * _MARGIN - _WORKING * largest - self._expected[5]
        f, s = 1.0, 0.0  # infeasible: all in sqrt(n) segments (an error at exit)
        for i in range(_GRID + 1):
            if self._need(i / _GRID, 1 - i / _GRID) <= budget:
                f, s = i / _GRID, 1 - i / _GRID
                break
        if f == 0.0:
            for i in range(_GRID + 1):
                if self._need(0.0, i / _GRID) <= budget:
                    s = i / _GRID
                    break
        self._regions = (f * total, (f + s) * total)
        self._segment_bytes = max(mean, math.sqrt(f * total * mean))

    def _region(self):
        """Under a planned budget, the part the computation is in: "sqrt", "selective"
        or "kept"; None otherwise."""
        if self.policy != "memory_budget" or self._expected is None:
            return None
        if self._computed < self._regions[0]:
            return "sqrt"
        return "selective" if self._computed < self._regions[1] else "kept"

    def flush(self):
        """Records every segment not recorded yet (at scope exit and value requests)."""
        if self._open is not None:
            self._close()
        if not self._pending:
            return
        if not _record.could_possibly_record():
            return  # no tape records now; recorded when one does
        pending, self._pending, self._lagging = self._pending, [], None
        for segment in pending:
            segment.ordered = self.in_order
            self._record(segment)
        if self.policy == "sqrt" and self.checkpoint_thinning:
            count, size = recompute_thinning.thin(
                pending, self.checkpoint_thinning,
                self.evict_min_bytes if self.evict_min_bytes is not None else _MIN_DROP_BYTES)
            self._thinned += count
            self._thinned_bytes += size
        for segment in pending:
            segment.sources, segment.pieces = None, ()  # (producers held by recipes only)

    # -- the representation ---------------------------------------------------------------

    # Representations are `_Value`s, or the next stack's tensor itself for resources and
    # variants (a dataset, a list), which are never recomputed.

    def value_dtype(self, value):
        return _described(value).dtype

    def num_dims(self, value):
        rank = _described(value).shape.rank
        return -1 if rank is None else rank

    def dim(self, value, index):
        d = _described(value).shape[index]
        return -1 if d is None else int(d)

    def static_value(self, value):
        return tf.get_static_value(_tensor_of(value))

    def device_string(self, value, stack):
        return _described(value).device

    def tensor_debug_string(self, value):
        from tensorflow.python.framework import ops  # pylint: disable=import-outside-toplevel
        return ops.value_text(_tensor_of(value))

    def copy_off(self, value, device):
        # A value request (tape.gradient asking for the tape's view of a target or
        # source, .numpy()): the tapes must know the segments computing it.
        if type(value) is _Value and value.segment is not None:
            self.flush()
        return _tensor_of(value)

    def function_input(self, value):
        if type(value) is _Value and value.segment is not None:
            self.flush()
        return None, [_tensor_of(value)]

    def function_output(self, summary, tensors):
        return _Value(tensors[0], tracked=True)

    # Inputs from elsewhere enter as they are (answered in C by the stack).
    needs_copy = staticmethod(never_copy)

    # -- the handler ----------------------------------------------------------------------

    def execute(self, op, inputs):
        below = self.next
        if below is not self._below:
            self._below_stack(below)
        if op.output_dtype_enums is None and self._depth \
                and not self._as_is and recompute_calls.applies(op):
            # The forward function of a tf.function call a tape records (TensorFlow
            # calls it with recording stopped): run as a segmented rewrite.
            if any(type(v) is _Value and v.segment is not None for v in inputs):
                self.flush()
            outputs, segments = recompute_calls.run(self, op, self._tensors(inputs), below)
            if outputs is not None:
                self._calls += 1
                self._call_segments += segments
                return self._wrap(outputs, True)
        if self._as_is or not _record.could_possibly_record():
            # No tape records: nothing to checkpoint (also during a backward pass). Under a
            # recording tf.GradientTape nothing can be saved (it keeps the scope's values
            # itself) and a segment's gradient, one call of a cached function, is not
            # differentiable by that tape: its gradient of an oh tape's gradient was None.
            # So each op is recorded as it is; also under an accumulator (_below_stack).
            if any(type(v) is _Value and v.segment is not None for v in inputs):
                self.flush()
            return self._wrap(below.execute(op, self._tensors(inputs)), False)
        enums = op.output_dtype_enums
        interior = any(type(v) is _Value and v.segment is not None for v in inputs)
        trainable_out = enums is None or any(e in _TRAINABLE for e in enums)
        if not trainable_out:
            return self._wrap(below.execute(op, self._tensors(inputs)), False)
        recomputable = (enums is not None and not _is_stateful(op.type)
                        and not any(e in _OPAQUE for e in enums)
                        and not any(_described(v).dtype.as_datatype_enum in _OPAQUE
                                    for v in inputs))
        if recomputable:
            tracked = [self._is_tracked(v) for v in inputs]
            if any(tracked):
                # Under a memory budget, past the part planned for recomputation, a kept
                # segment: it holds its values and its gradient function takes them (the
                # backward pass at graph speed, without recomputation).
                return self._run_in_segment(op, inputs, tracked, keep=self._keep_all(),
                                            partial=self._region() == "selective")
            return self._wrap(below.execute(op, self._tensors(inputs)), False)
        return self._run_kept(op, inputs, interior)

    def _below_stack(self, below):
        """Ops run as they are with an accumulator or a map below (recompute_calls.as_is)."""
        self._below = below
        reason = recompute_calls.as_is(below)
        self._as_is = self._tf_tape or reason is not None
        if reason is not None and not self._warned_forward:
            self._warned_forward = True
            warnings.warn(reason, RuntimeWarning, stacklevel=_user_stacklevel())

    def _run_kept(self, op, inputs, interior):
        """Runs `op` as it is; the tape records it itself, so the segments computing its
        inputs are recorded first."""
        if interior:
            self.flush()
        tracked = any(self._is_tracked(v) for v in inputs)
        outputs = self.next.execute(op, self._tensors(inputs))
        if op.type == "ReadVariableOp" and outputs and _trainable(outputs[0]):
            # The variable's gradient is computed during the backward pass too: its
            # bytes come off a memory budget (once per variable).
            handle = self._tensor(inputs[0])
            if id(handle) not in self._variables:
                self._variables[id(handle)] = handle  # (held: ids stay unique)
                self._params += nbytes(outputs[0])
        return self._wrap(outputs, tracked)

    def _count_values(self, op_type, outputs):
        sizes = [nbytes(o) for o in outputs]
        size = sum(sizes)
        if op_type in EXPENSIVE_OPS:
            self._expensive += size
            self._max_run, self._run = max(self._max_run, self._run), 0
        else:
            self._run += size
        self._computed += size
        self._count += len(outputs)
        if sizes and max(sizes) > self._largest_value:
            self._largest_value = max(sizes)
        return size

    _tensor = staticmethod(_tensor_of)

    @staticmethod
    def _tensors(inputs):
        return [_tensor_of(v) for v in inputs]

    @staticmethod
    def _wrap(outputs, tracked):
        return [o if o.dtype.as_datatype_enum in _OPAQUE
                else _Value(o, tracked=tracked and _trainable(o)) for o in outputs]

    def _is_tracked(self, v):
        if type(v) is _Value:
            if v.segment is not None or v.tracked:
                return True
            v = v.tensor  # a tape may have watched it since (tape.watch in the scope)
        return gradients_util.PossibleTapeGradientTypes([v]) != 0

    def _keep_all(self):
        """Under a memory budget, past the part planned for recomputation."""
        return self._region() == "kept"

    def _run_in_segment(self, op, inputs, tracked, keep=False, partial=False):
        segment = self._open
        join, self._join_end = self._join_end, None
        if join is not None and segment is join[0]:
            if self._continues_join(segment, join[1], inputs, tracked):
                values = self._append(segment, op, inputs, tracked, keep, partial)
                self._close(evict=True)
                return values
            self._close(evict=True)
            segment = None
        if segment is not None and ((segment.saved is not None) != (keep or partial)
                                    or segment.partial != partial
                                    or self._segment_full(segment)):
            self._close(evict=True)
            segment = None
        if segment is None:
            segment = self._open = Segment(keep=keep, partial=partial)
        values = self._append(segment, op, inputs, tracked, keep, partial)
        if keep or (partial and op.type in EXPENSIVE_OPS):
            return values
        if self.policy == "save" and op.type in self.save:
            self._close(evict=True)
        elif self.policy == "sqrt" and _is_join(inputs, [v.tensor for v in values]):
            self._joins = True
            if segment.bytes >= self.join_fraction * self._sqrt_bytes():
                # Ends after the next op if that op only maps the join's value (the
                # activation after a residual add): the checkpoint is then the value
                # the next block reads, which its gradient function takes as it is,
                # instead of the sum it would map again and keep to its end.
                self._join_end = (segment, len(segment.nodes) - 1)
        return values

    @staticmethod
    def _continues_join(segment, node, inputs, tracked):
        """Whether an op with `inputs` maps the output of `segment`'s join `node` alone
        (one input from the segment, that output, and no other tracked input)."""
        shape = _described(inputs[0]).shape if inputs else None
        found = False
        for v, tr in zip(inputs, tracked):
            if type(v) is _Value and v.segment is segment:
                if v.node != node or _described(v).shape != shape:
                    return False
                found = True
            elif tr:
                return False
        return found

    def _append(self, segment, op, inputs, tracked, keep, partial):
        """Runs `op` (tapes paused) as the next node of `segment`; its values."""
        refs = []
        for v, tr in zip(inputs, tracked):
            if type(v) is _Value and v.segment is segment:
                refs.append((v.node, v.index))
                continue
            j = segment.external(self._tensor(v), tr)
            if type(v) is _Value and v.segment is not None:
                # A value of a closed segment not recorded yet: one of its outputs (a
                # checkpoint the thinning may drop: its recipe is that node).
                v.segment.used[(v.node, v.index)] = _tensor_of(v)
                if segment.sources is None:
                    segment.sources = {}
                segment.sources.setdefault(j, (v.segment, v.node, v.index))
            refs.append((-1, j))
        with _record.stop_recording():
            outputs = self.next.execute(op, self._tensors(inputs))
        node = len(segment.nodes)
        segment.nodes.append((op, tuple(refs)))
        values = [_Value(o, segment, node, k) for k, o in enumerate(outputs)]
        segment.values.append([weakref.ref(v) for v in values])
        segment.bytes += self._count_values(op.type, outputs)
        if keep or (partial and op.type in EXPENSIVE_OPS):
            segment.saved.append(list(outputs))
        elif partial:
            segment.saved.append(None)  # recomputed by the gradient function
        return values

    def _segment_full(self, segment):
        if self.policy == "save" or (segment.saved is not None and not segment.partial):
            return False
        region = self._region()
        if region == "sqrt":
            return segment.bytes >= self._segment_bytes
        if region == "selective":
            return segment.bytes >= self._selective_cap()
        if self._joins or (self._expected is not None and self._expected[6]):
            # Segments end at joins (above); a long run without one still ends.
            return segment.bytes >= self.join_cap * self._sqrt_bytes()
        return segment.bytes >= self._sqrt_bytes()

    def _sqrt_bytes(self):
        """sqrt(total bytes x mean value bytes): the sqrt policy's segment size."""
        total, count = self._computed, max(self._count, 1)
        if self._expected is not None:
            total = max(total, self._expected[0])
        return math.sqrt(total * (self._computed / count))

    def _close(self, evict=False):
        segment, self._open = self._open, None
        self._join_end = None
        if segment is None or not segment.nodes:
            return
        if segment.saved is None or segment.partial:
            self._largest = max(self._largest, segment.bytes)
        # Recorded at the scope's exit (or a value request, or before a kept op that uses
        # its values): by then the program has dropped the values its layers held while
        # they ran (a Keras functional model holds every layer's output until the call
        # returns), so only values used by later segments, which the segment holds
        # meanwhile, or still referenced are kept. Meanwhile (a segment closed while the
        # forward pass goes on) the values the program holds are dropped, to be
        # rematerialized when used (evict.py), one segment late: a residual
        # input is typically read again soon after its segment closed.
        if evict and self.evict_min_bytes is not None:
            lagging, self._lagging = self._lagging, segment
            if lagging is not None:
                self._evicted += recompute_evict.evict(lagging, self.next,
                                                       self.evict_min_bytes)
        self._pending.append(segment)

    def _record(self, segment):
        recompute_evict.restore(segment)  # values the program holds are outputs
        self._remat_ops += segment.remat_ops
        try:
            outputs = record(segment, _trainable)
        except Exception as e:
            raise HandlerError("oh.Recompute: recording a segment of %d ops (%s ...) "
                               "failed: %s" % (len(segment.nodes), ", ".join(
                                   op.type for op, _ in segment.nodes[:4]), e)) from e
        self.segments += 1
        recorded = dict(outputs)
        # The tapes' record keeps the segment (its gradient function is built from it)
        # until its backward call: the values later segments used, its outputs, are
        # theirs to hold, not its own (its backward recomputes instead).
        segment.used = {}
        for n, refs in enumerate(segment.values):
            for k, ref in enumerate(refs):
                v = ref()
                if v is not None:
                    v.segment = None
                    v.tracked = (n, k) in recorded
        self._kept += sum(nbytes(t) for _, t in outputs)
        if segment.partial:
            for (op, _), ts in zip(segment.nodes, segment.saved):
                if ts is None:
                    self._recomputed[op.type] = self._recomputed.get(op.type, 0) + 1
        elif segment.saved is None:
            # The ops its gradient function recomputes: all but those whose outputs are
            # all recorded (kept) and unused inside (pruned from the function when their
            # gradient does not need them, as for contractions and convolutions).
            consumed = {r for _, refs in segment.nodes for r in refs if r[0] >= 0}
            for n, (op, _) in enumerate(segment.nodes):
                if any((n, k) not in recorded or (n, k) in consumed
                       for k in range(len(segment.values[n]))) \
                        or op.type not in EXPENSIVE_OPS:
                    self._recomputed[op.type] = self._recomputed.get(op.type, 0) + 1
