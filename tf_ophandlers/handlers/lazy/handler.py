"""`Lazy`: ops accumulate instead of running; a value request compiles and runs them
(RFC "Tracing eager operations and LazyTensor-like setups").

>>> import tensorflow as tf, tf_ophandlers as oh
>>> with oh.Lazy() as lazy:
...     h = tf.ones([16, 16])
...     for _ in range(100):
...         h = tf.tanh(h) * 1.01      # nothing runs yet
...     total = float(tf.reduce_sum(h))  # a value request: one compiled function runs
>>> lazy.compiled + lazy.cache_hits, lazy.flushes  # one function, built or cached
(1, 1)

An op on the handler becomes a node of a pending graph; its outputs are tensors of the
handler whose dtypes come from the OpDef and whose shapes are inferred (TensorFlow's
shape functions, only when asked for). A value request — `.numpy()`, printing, a copy
off the handler, a Python decision (`if t > 0:`) — compiles the pending subgraph that
the value depends on into a function, cached by its structure (op types, attributes,
wiring, devices and input specs) in one process-wide cache that every `Lazy()` shares
(handlers/lazy/compiler.py; `Lazy(jit_compile=True)` compiles with XLA), and runs it
once. The values the program still references (and those other pending ops need) are
kept; intermediate values nobody can ask for
stay inside the function. Stateful ops (variables, random ops with state, prints) and
`tf.function` calls run eagerly in program order, after their inputs are computed.
Results equal eager execution. With `chunk_ops=N`, every N recorded ops are launched as
one compiled call (from the cache) on an asynchronous executor while recording goes on;
a kernel error of a chunk is raised at the next value request or scope exit.
"""
import itertools
import operator
import threading
import weakref

import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import context as _context
from tensorflow.python.eager import executor as _executor
from tensorflow.python.framework import op_def_registry
from tensorflow.python.framework import ops as _ops

from tf_ophandlers.extend import (
    BoundedCache, lazy_computed, lazy_plan, lazy_record_setup, lazy_upstream, never_copy,
    next_stack, OpHandler, PHYSICAL, shapes, stack_of, state as _state, tensor_key,
    with_message)
from tf_ophandlers.handlers.lazy import compiler as lazy_compile

_stateful = BoundedCache("lazy.stateful_ops", 4096)  # op type -> whether it runs eagerly
_dtypes = BoundedCache("lazy.dtypes", 256)  # TF_DataType enum -> tf.DType
_sequence = itertools.count()
_sigs = lazy_compile.sigs  # (op type, output dtypes) -> a node's signature
_tape_set_stopped = pywrap_tfe.TFE_Py_TapeSetIsStopped
_RESOURCE = tf.resource
_RESOURCE_ENUM = tf.resource.as_datatype_enum
_EagerTensor = _ops.EagerTensor
_get_executor = pywrap_tfe.TFE_ContextGetExecutorForThread
_set_executor = pywrap_tfe.TFE_ContextSetExecutorForThread
_delete_executor = pywrap_tfe.TFE_DeleteExecutor


_threads = threading.local()  # .executor: this thread's async executor for chunks
# A compiled chunk's outputs: ((TensorSpec, spec key), ...) from its function's outputs,
# or None when a shape is not fully defined. Weak keys: an entry leaves with the
# function cache's CompiledCall (no tensor is kept).
_chunk_specs = weakref.WeakKeyDictionary()


def _async_executor():
    """This thread's asynchronous TensorFlow executor (its own thread runs the kernels)."""
    ex = getattr(_threads, "executor", None)
    if ex is None:
        ex = _threads.executor = _executor.new_executor(enable_async=True)
    return ex


def _run_async(entry, external):
    """`entry` called on this thread's asynchronous executor, as under
    `context.executor_scope`, which wraps the thread's previous executor in an `Executor`
    whose deletion at the scope's end waits for that executor's pending nodes: a runtime
    call on every launch of the record path. Here the previous executor's handle (an
    unowned reference) is put back and freed without waiting; the launch added nothing
    to that executor."""
    handle = _context.context()._context_handle  # pylint: disable=protected-access
    previous = _get_executor(handle)
    _set_executor(handle, _async_executor().handle())
    try:
        return entry.run(PHYSICAL, external)
    finally:
        _set_executor(handle, previous)
        _delete_executor(previous)


def _is_stateful(op_type):
    s = _stateful.get(op_type)
    if s is None:
        op_def = op_def_registry.get(op_type)
        s = _stateful[op_type] = op_def is None or op_def.is_stateful
    return s


class _Node:
    """A recorded op. Its inputs are `(node, index)` pairs for pending outputs of other
    nodes, or tensors of the next stack. Nodes refer to their inputs' nodes, never to
    the LazyValues the program holds, so a value the program dropped is known to be
    unreferenced (its weak reference is dead) and is not returned by the function."""

    __slots__ = ("op", "sig", "inputs", "outputs", "values", "specs", "next", "failed",
                 "seq", "device", "__weakref__")

    def __init__(self, op, sig, inputs, next_stack):
        self.seq = next(_sequence)  # recording order
        self.sig = sig  # (op type, attributes) (_signature): all a key needs
        # The Op itself only over another handler (run op by op); see _op.
        self.op = None if next_stack is PHYSICAL else op
        self.device = _state.device  # the `tf.device` placement it was recorded under
        self.inputs = inputs  # None once computed
        self.outputs = None  # weak references to the LazyValues (no reference cycle)
        # Once computed: the outputs that pending nodes still need, by index.
        self.values = None
        self.specs = None  # output TensorSpecs, when inferred
        self.next = next_stack  # where the compiled function runs
        self.failed = False  # its computation raised: run again only when asked


class LazyValue:
    """The representation: a pending output of a node, or a computed tensor."""

    __slots__ = ("node", "index", "dtype", "value", "__weakref__")

    def __init__(self, node, index, dtype, value=None):
        self.node = node
        self.index = index
        self.dtype = dtype
        self.value = value  # the tensor of the next stack, once computed

    def __repr__(self):
        return "LazyValue(%s:%d, %s)" % (
            self.node.sig[0] if self.node is not None else "input", self.index,
            "pending" if self.value is None else "computed")


def _upstream(roots, follow):
    """`roots` and the nodes they depend on through producers for which `follow` holds,
    in topological order (the order of recording: an op is recorded after the ops that
    produce its inputs). A loop, not recursion: a chain of pending ops can be thousands
    long. (A value request's walk, through every pending producer, is `lazy_upstream`.)"""
    seen, todo = {}, list(roots)
    while todo:
        node = todo.pop()
        if node.seq in seen:
            continue
        seen[node.seq] = node
        for i in node.inputs:
            if type(i) is tuple and follow(i[0]):
                todo.append(i[0])
    return [seen[k] for k in sorted(seen)]


def _named(e, types, what=""):
    """`e` (an OpError) as the same error class whose message names `oh.Lazy` and the
    pending op types that ran (TensorFlow's message names the failing node)."""
    message = e.message.split("\n\tEncountered when executing an operation using "
                              "EagerExecutor")[0]  # (a chunk's: the error is cleared)
    message = "oh.Lazy: %spending ops (op types %s) failed: %s" % (
        what, ", ".join(sorted(types)), message)
    error = with_message(e, message)
    error.oh_lazy = True
    return error


def _spec_key(t):
    """(dtype enum, shape tuple or None) of a tensor or TensorSpec, as lazy_plan gives
    an external input's part of the key."""
    if type(t) is _EagerTensor:
        return (t._datatype_enum(), t._shape_tuple())  # pylint: disable=protected-access
    shape = t.shape
    return (t.dtype.as_datatype_enum, None if shape.rank is None else tuple(shape.as_list()))


def _output_specs(function):
    """((TensorSpec, spec key), ...) of `function`'s outputs, or None if a shape is not
    fully defined (a launched chunk's outputs are then awaited)."""
    specs = []
    for s in function.outputs:
        shape = s.shape
        if not shape.is_fully_defined():
            return None
        spec = tf.TensorSpec(shape, s.dtype)
        specs.append((spec, _spec_key(spec)))
    return tuple(specs)


def _dtype(enum):
    d = _dtypes[enum] = tf.as_dtype(enum)
    return d


def _ready(tensor):
    return LazyValue(None, 0, tensor.dtype, tensor)


# What the C++ record path (cc/handlers/lazy/fast_lazy.cc) builds and reads: these types (by slot),
# the sequence numbers and the caches `Lazy.execute` fills.
lazy_record_setup(LazyValue, _Node, _sequence, _sigs, _dtypes, _stateful)


class Lazy(OpHandler):
    """Defers ops until a value is needed, then runs the pending ops as one function.

    Args:
      jit_compile: compile the pending ops with XLA (`tf.function(jit_compile=True)`),
        ops without an XLA kernel running as ordinary kernels between XLA calls.
      chunk_ops: None (run pending ops only at a value request or scope exit), or a
        number of ops: each time that many ops are pending, they are launched as one
        compiled call (once compiled, from the cache) on an asynchronous executor, so
        that its kernels run on another core while Python keeps recording. A kernel
        error of a chunk is raised at the next value request or scope exit.

    >>> x = tf.ones([8, 8])
    >>> with oh.Lazy(jit_compile=True):
    ...     y = tf.reduce_sum(tf.tanh(x) * 2.0)
    ...     float(y) > 0
    True
    """

    TYPE_NAME = "LAZY"
    # The pending graph, the chunks in flight and their errors belong to the open scope
    # and are kept on the instance: a second thread would run, or raise, the other's ops.
    one_thread_at_a_time = True
    replays_functions = False  # a tf.function call is already one compiled op
    # Inputs from elsewhere (a physical tensor, a Python constant) enter a node as they
    # are: wrapping each would cost more than the op it feeds (C-level, no Python call).
    needs_copy = staticmethod(never_copy)
    # A representation's dtype, read by the C++ path per output: a C callable, no frame.
    value_dtype = operator.attrgetter("dtype")
    # The C++ path records this class's common ops itself (cc/handlers/lazy/fast_lazy.cc builds the
    # _Node and LazyValues `execute` builds): no Python frame per op. A subclass that
    # overrides `execute` or `needs_copy` gets its hook called.
    _oh_records_in_c = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.execute is not Lazy.execute or cls.needs_copy is not Lazy.needs_copy:
            cls._oh_records_in_c = False

    def __init__(self, jit_compile=False, chunk_ops=None):
        if not isinstance(jit_compile, bool):
            raise TypeError("oh.Lazy: jit_compile must be True or False, not %r"
                            % (jit_compile,))
        if chunk_ops is not None and (type(chunk_ops) is not int or chunk_ops < 1):
            raise ValueError("oh.Lazy: chunk_ops must be None or a positive int, not %r"
                             % (chunk_ops,))
        self.jit_compile = jit_compile
        self.chunk_ops = chunk_ops
        self._recorded = 0  # ops recorded since the last chunk
        # Outputs of chunks launched since the last wait: tensor key -> (tensor, spec);
        # their shapes come from the function (asking the tensor would wait for it).
        self._inflight = {}
        self._chunk_ops_types = []  # op types of those chunks (for error messages)
        self._deferred = None  # a chunk's error raised while recording, raised later
        self.chunks = 0  # chunks launched asynchronously
        self._pending = []  # weak references to nodes, some computed or gone (pruned)
        self._live_nodes = 64  # prune _pending when it grows past twice this
        self._depth = 0
        self.compiled = 0      # functions this handler built (process-wide cache misses)
        self.cache_hits = 0    # compiled functions it found in the process-wide cache
        self.flushes = 0       # value requests that ran pending ops (chunks: `chunks`)
        self.last_function = None  # the ConcreteFunction its last compiled run called

    def scope_entered(self):
        self._depth += 1

    def scope_exited(self):
        # Pending ops run when the scope closes: the handlers the scope was opened in (a
        # tape recording the computation) must see them while they are active.
        self._depth -= 1
        if self._depth == 0:
            self.settle()

    def flush(self):
        """Runs every pending op whose result is still referenced."""
        by_next = {}
        for r in list(self._pending):
            n = r()
            if (n is not None and n.inputs is not None and not n.failed
                    and any(o() is not None for o in n.outputs)):
                by_next.setdefault(id(n.next), []).append(n)
        try:
            for roots in by_next.values():
                self._run(roots)
        finally:
            self._prune()

    def settle(self):
        """Runs every pending op whose result is still referenced and waits for launched
        chunks: an error of any of them is raised here."""
        try:
            self.flush()
        finally:
            if self._inflight or self._deferred is not None:
                self._wait()

    def run_deferred(self):
        """`flush()`, for a handler below about to change how it treats ops (a tape that
        pauses: core/stack.py's `run_deferred_above`)."""
        self.flush()

    def debug_string(self):
        return "Lazy(jit_compile=True)" if self.jit_compile else "Lazy()"

    # -- the representation ---------------------------------------------------------------

    def _spec(self, v):
        """The TensorSpec of a value (shape inference on demand, memoized)."""
        if v.value is not None:
            return self._tensor_spec(v.value)
        return self._output_spec(v.node, v.index)

    def _tensor_spec(self, t):
        if self._inflight:
            entry = self._inflight.get(tensor_key(t))
            if entry is not None:
                return entry[1]
        return tf.TensorSpec(t.shape, t.dtype)

    def _output_spec(self, node, index):
        if node.inputs is None:  # computed: a pending node still needs this output
            return self._tensor_spec(node.values[index])
        if node.specs is None:
            # The pending producers without specs, inferred in recording order.
            chain = _upstream([node], lambda p: p.inputs is not None and p.specs is None)
            for n in chain:
                if n.inputs is not None and n.specs is None and not self._infer_node(n):
                    # The shape depends on values only the computation gives (eager
                    # tensors have known shapes; Python code relies on them): compute it.
                    self._run([n], keep=(node, index) if n is node else None)
            if node.inputs is None:
                return self._output_spec(node, index)
        return node.specs[index]

    def _infer_node(self, node):
        """Sets `node.specs` from TensorFlow's shape functions; False if they are not
        fully defined (or inference fails)."""
        # Producers are computed or inferred already (recording order).
        inflight = self._inflight
        specs = [shapes.Spec(self._output_spec(*i)) if type(i) is tuple
                 else shapes.Spec(inflight[tensor_key(i)][1])
                 if inflight and tensor_key(i) in inflight
                 else shapes.spec_of(i) for i in node.inputs]
        if shapes.assumes_success(specs):
            return False  # the kernel decides (it may reject the op, as eagerly)
        try:
            outs = shapes.infer(lazy_compile.op_of(node), specs)
        except (ValueError, TypeError, tf.errors.OpError):
            return False
        if not all(s.shape.is_fully_defined() for s in outs):
            return False
        node.specs = outs
        return True

    def num_dims(self, value):
        rank = self._spec(value).shape.rank
        return -1 if rank is None else rank

    def dim(self, value, index):
        d = self._spec(value).shape[index]
        return -1 if d is None else int(d)

    def static_value(self, value):
        t = value.value
        if t is None:
            return None
        if self._inflight and tensor_key(t) in self._inflight:
            self._wait()  # a chunk's output: its value (or its chunk's error) now
        return tf.get_static_value(t)

    def tensor_debug_string(self, value):
        from tensorflow.python.framework import ops  # pylint: disable=import-outside-toplevel
        return ops.value_text(self._force(value))  # printing is a value request

    def copy_on(self, tensor):
        source = stack_of(tensor)
        if source is not None and source.handler is self:
            # A tensor of this handler from an earlier merge: its value, computed on
            # that merge's next stack, moved onto this one.
            value = self._force(source.unwrap(tensor))
            return _ready(next_stack().copy_on(value))
        return _ready(super().copy_on(tensor))

    def copy_off(self, value, device):
        return self._force(value)

    # -- the handler ----------------------------------------------------------------------

    changes_computation = False  # runs each op as it is, deferred

    def execute(self, op, inputs):
        # The record path runs for every op of the scope: kept to plain loops and
        # C-level lookups (benchmarks/small_ops.py measures it against eager).
        if self._recorded and self._recorded >= self.chunk_ops:
            # Launched before recording the next op (not after the last one): by now
            # the program has dropped the intermediate values of its last statement,
            # so the chunk returns only what is still referenced.
            self._launch_chunk()
        enums = op.output_dtype_enums
        node_inputs = None
        if enums is not None and not (_state.current is not PHYSICAL and _tape_set_stopped()):
            # (While TensorFlow's recording is stopped, a tape below records nothing: the
            # op runs now, not when a value request finds recording on again.)
            stateful = _stateful.get(op.type)
            if stateful is None:
                stateful = _is_stateful(op.type)
            if not stateful:
                node_inputs = []
                for v in inputs:
                    kind = type(v)
                    if kind is LazyValue:
                        if v.dtype is _RESOURCE:
                            node_inputs = None
                            break
                        if v.value is None:
                            v = (v.node, v.index)
                        else:
                            v = v.value
                    elif (v._datatype_enum() == _RESOURCE_ENUM if kind is _EagerTensor  # pylint: disable=protected-access
                          else v.dtype is _RESOURCE):
                        node_inputs = None
                        break
                    node_inputs.append(v)
        if node_inputs is None:
            # Runs now, in program order, on computed inputs. A side effect first runs
            # what was recorded before it: an error there stops the program before the
            # effect happens, as eagerly (dropped values stay unrun, as always).
            if self._pending and lazy_compile.has_effects(op.type):
                self.settle()
            outputs = self.next.execute(op, [self._force(v) if type(v) is LazyValue else v
                                             for v in inputs])
            return [o if o.dtype is _RESOURCE else _ready(o) for o in outputs]
        sig = _sigs.get((op.type, enums))
        if sig is None:
            sig = lazy_compile.signature(op, enums)
        node = _Node(op, sig, node_inputs, _state.current)  # (current: the stack below)
        if len(enums) == 1:  # most ops: no comprehension frames
            e = enums[0]
            o = LazyValue(node, 0, _dtypes.get(e) or _dtype(e))
            node.outputs = [weakref.ref(o)]
            outputs = [o]
        else:
            get = _dtypes.get
            outputs = [LazyValue(node, i, get(e) or _dtype(e)) for i, e in enumerate(enums)]
            node.outputs = [weakref.ref(o) for o in outputs]
        pending = self._pending
        pending.append(weakref.ref(node))
        if self.chunk_ops is not None and node.next is PHYSICAL:
            self._recorded += 1
        elif len(pending) > 2 * self._live_nodes:
            self._prune()
        return outputs

    def _launch_chunk(self):
        """Launches the pending ops (on the physical devices) as one compiled call."""
        self._recorded = 0
        roots = []
        for r in self._pending:
            n = r()
            if n is None or n.inputs is None or n.failed or n.next is not PHYSICAL:
                continue
            for o in n.outputs:
                if o() is not None:
                    roots.append(n)
                    break
        try:
            if roots:
                self._run(roots, chunk=True)
        except tf.errors.OpError as e:
            # (a chunk run at once: its first call, compiling) raised at the value
            # request, as a launched chunk's error is; its ops are marked failed.
            if self._deferred is None:
                self._deferred = (e, {n.sig[0] for n in roots})
        finally:
            self._prune()

    def _launch(self, entry, external, order):
        """Calls compiled `entry` on the async executor; its outputs' specs (from the
        function) are kept so that recording goes on without waiting for them."""
        outputs = _run_async(entry, external)
        self.chunks += 1
        self._chunk_ops_types.append({node.sig[0] for node in order})
        specs = _chunk_specs.get(entry, False)
        if specs is False:
            specs = _chunk_specs[entry] = _output_specs(entry.function)
        if specs is None:
            self._wait()  # rare: a shape is only known once computed
        else:
            inflight = self._inflight
            for t, s in zip(outputs, specs):
                inflight[tensor_key(t)] = (t,) + s
        return outputs

    def _wait(self):
        """Waits for the chunks launched so far; a kernel error of one is raised here,
        naming the handler and the chunk's ops, and the executor is usable again."""
        self._inflight = {}
        types, self._chunk_ops_types = self._chunk_ops_types, []
        deferred, self._deferred = self._deferred, None
        ex = _async_executor()
        try:
            ex.wait()
            if deferred is not None:
                types = [deferred[1]]
                raise deferred[0]
        except tf.errors.OpError as e:
            ex.clear_error()
            if getattr(e, "oh_lazy", False):
                raise  # wrapped already (an earlier wait, deferred)
            raise _named(e, {t for chunk in types for t in chunk}, "a compiled chunk of ") from e

    def _prune(self):
        """Drops the references to computed and collected nodes from `_pending` (failed
        ones stay: run again if asked, they may need the values of other nodes)."""
        kept = []
        for r in self._pending:
            n = r()
            if n is not None and n.inputs is not None:
                kept.append(r)
        self._pending = kept
        self._live_nodes = max(64, len(kept))

    def _force(self, value):
        """The computed tensor of `value`, running its pending subgraph if needed."""
        if value.value is None:
            self._run([value.node])
        if self._inflight or self._deferred is not None:
            self._wait()  # a chunk's error is raised at the value request
        return value.value

    def _run(self, roots, keep=None, chunk=False):
        """`_compute`, with TensorFlow's recording on if a value request finds it stopped
        (inside a function call's execution, or `stop_recording`): pending ops over a
        handler were recorded while it was on (`execute`), so a tape below records them."""
        if roots[0].next is PHYSICAL or not _tape_set_stopped():
            return self._compute(roots, keep, chunk)
        pywrap_tfe.TFE_Py_TapeSetRestartOnThread()
        try:
            return self._compute(roots, keep, chunk)
        finally:
            pywrap_tfe.TFE_Py_TapeSetStopOnThread()

    def _compute(self, roots, keep=None, chunk=False):
        """Computes the pending nodes `roots` and those they depend on, as one function.

        The function returns the outputs still referenced: by a LazyValue of the program,
        by a pending node outside this computation, or `keep` (a `(node, index)`). The
        others stay inside it (returning them would keep TensorFlow from freeing them).
        """
        # The pending nodes they depend on, in recording order (cc/handlers/lazy/fast_lazy_plan.cc).
        order = lazy_upstream(roots)
        needed = set() if keep is None else {(keep[0].seq, keep[1])}
        if len(self._pending) > len(order):
            # Outputs that pending nodes outside `order` will need (every pending node
            # is in `_pending`; when it holds only `order`'s, there are none).
            seen = {n.seq for n in order}
            for r in self._pending:
                c = r()
                if c is not None and c.inputs is not None and c.seq not in seen:
                    for i in c.inputs:
                        if type(i) is tuple and i[0].seq in seen:
                            needed.add((i[0].seq, i[1]))
        # The key's bytes (graph_builder.node_part's parts and the live outputs), the
        # outputs to keep and the external inputs, in one pass in C: this runs on every
        # value request. The plan only when the ops run one by one or compile (a cache
        # miss): (node, refs, live, device) per node, refs (-1, k) for external input k
        # or (p, i) for output i of plan entry p; kept: (node, output, its LazyValue or
        # None).
        inflight = self._inflight
        physical = order[-1].next is PHYSICAL
        plan, key, kept, external, specs = lazy_plan(order, needed, not inflight, not physical)
        if inflight:  # a chunk's outputs: the specs its function gives (not awaited)
            specs = []
            for t in external:
                e = inflight.get(tensor_key(t))
                specs.append(_spec_key(t) if e is None else e[2])
            specs = tuple(specs)
        # Everything the compiled function depends on (handlers/lazy/compiler.py): op
        # types, attributes, wiring, devices, live outputs, the inputs' dtypes and shapes.
        key = (key, specs, self.jit_compile)
        try:
            entry = lazy_compile.functions.get(key) if chunk else None
            if entry is not None:  # a chunk of a known structure: launched, not awaited
                outputs = self._launch(entry, external, order)
                self.cache_hits += 1
                self.last_function = entry.function
            else:
                if inflight or (self._deferred is not None and not chunk):
                    self._wait()  # a chunk's error first; compiling needs the shapes
                if not physical:
                    # A handler below (a tape) would see one function call: its gradient
                    # treats the call's outputs as one unit (a pending value the program
                    # keeps, e.g. a variable read's Identity, adds a dense zero to a
                    # gather's sparse gradient). It sees the ops one by one instead, as
                    # eagerly.
                    outputs = lazy_compile.run_op_by_op(plan, external)
                else:
                    entry = lazy_compile.functions.get(key)
                    if entry is not None:
                        outputs = entry.run(PHYSICAL, external)
                        self.cache_hits += 1
                    else:  # compiled from the nodes' Ops
                        plan = lazy_plan(order, needed, False, True)[0]
                        plan = [(lazy_compile.op_of(n), r, l, d) for n, r, l, d in plan]
                        outputs, built, entry = lazy_compile.run(key, plan, external,
                                                                 self.jit_compile)
                        if built:
                            self.compiled += built
                        else:  # (another thread compiled it meanwhile)
                            self.cache_hits += 1
                    self.last_function = entry.function
        except Exception as e:
            for node in order:  # a failed computation is not retried when the scope closes
                node.failed = True
            if not isinstance(e, tf.errors.OpError) or getattr(e, "oh_lazy", False):
                raise
            raise _named(e, {node.sig[0] for node in order},
                         "a compiled chunk of " if chunk else "") from e
        for (node, k, o), value in zip(kept, outputs):
            if o is not None:
                o.value = value
            if needed and (node.seq, k) in needed:
                if node.values is None:
                    node.values = [None] * len(node.outputs)
                node.values[k] = value
        lazy_computed(order)  # node.inputs = None for each: releases the inputs
        if len(self._pending) == len(order):
            # Every pending node was in `order` (each has one entry in `_pending`), now
            # computed: what _prune would keep is nothing (spares the scope exit's passes).
            self._pending = []
        self._recorded = 0  # chunks count the ops recorded since the last run
        if not chunk:
            self.flushes += 1
