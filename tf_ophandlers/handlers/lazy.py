"""`Lazy`: ops accumulate instead of running; a value request compiles and runs them
(RFC "Tracing eager operations and LazyTensor-like setups").

>>> import tensorflow as tf, tf_ophandlers as oh
>>> with oh.Lazy() as lazy:
...     h = tf.ones([16, 16])
...     for _ in range(100):
...         h = tf.tanh(h) * 1.01      # nothing runs yet
...     total = float(tf.reduce_sum(h))  # a value request: one compiled function runs
>>> lazy.compiled, lazy.flushes
(1, 1)

An op on the handler becomes a node of a pending graph; its outputs are tensors of the
handler whose dtypes come from the OpDef and whose shapes are inferred (TensorFlow's
shape functions, only when asked for). A value request — `.numpy()`, printing, a copy
off the handler, a Python decision (`if t > 0:`) — compiles the pending subgraph that
the value depends on into a function, cached by its structure (op types, attributes,
wiring and input specs), and runs it once; every value it computed is kept. Stateful
ops (variables, random ops with state, prints) and `tf.function` calls run eagerly in
program order, after their inputs are computed. Results equal eager execution.
"""
import weakref

import tensorflow as tf
from tensorflow.python.framework import op_def_registry

from tensorflow.python.framework import ops as _ops

from tf_ophandlers import _C
from tf_ophandlers.core import replay as _replay
from tf_ophandlers.core.handler import OpHandler
from tf_ophandlers.core.state import state as _state
from tf_ophandlers.handlers import shape_inference as _shape_inference

_stateful = {}  # op type -> whether it must run eagerly
_RESOURCE = tf.resource
_CACHE_SIZE = 256


def _is_stateful(op_type):
    s = _stateful.get(op_type)
    if s is None:
        op_def = op_def_registry.get(op_type)
        s = _stateful[op_type] = op_def is None or op_def.is_stateful
    return s


class _Node:
    __slots__ = ("op", "inputs", "outputs", "next", "__weakref__")

    def __init__(self, op, inputs, next_stack):
        self.op = op
        self.inputs = inputs  # LazyValue or tensors of the next stack; None once computed
        self.outputs = None  # weak references to the LazyValues (no reference cycle)
        self.next = next_stack  # where the compiled function runs


class LazyValue:
    """The representation: a pending output of a node, or a computed tensor."""

    __slots__ = ("node", "index", "dtype", "value", "_spec", "__weakref__")

    def __init__(self, node, index, dtype, value=None):
        self.node = node
        self.index = index
        self.dtype = dtype
        self.value = value  # the tensor of the next stack, once computed
        self._spec = None

    def __repr__(self):
        return "LazyValue(%s:%d, %s)" % (
            self.node.op.type if self.node is not None else "input", self.index,
            "pending" if self.value is None else "computed")


def _ready(tensor):
    return LazyValue(None, 0, tensor.dtype, tensor)


class Lazy(OpHandler):
    """Defers ops until a value is needed, then runs the pending ops as one function."""

    TYPE_NAME = "LAZY"
    replays_functions = False  # a tf.function call is already one compiled op

    def __init__(self):
        self._functions = {}   # structure key -> replay.CompiledCall
        self._pending = weakref.WeakSet()  # nodes not computed yet
        self._depth = 0
        self.compiled = 0      # functions built
        self.flushes = 0       # value requests that ran pending ops

    def scope_entered(self):
        self._depth += 1

    def scope_exited(self):
        # Pending ops run when the scope closes: the handlers the scope was opened in (a
        # tape recording the computation) must see them while they are active.
        self._depth -= 1
        if self._depth == 0:
            self.flush()

    def flush(self):
        """Runs every pending op whose result is still referenced."""
        by_next = {}
        for n in list(self._pending):
            if n.inputs is not None:
                by_next.setdefault(id(n.next), []).extend(
                    o for o in (r() for r in n.outputs) if o is not None)
        for roots in by_next.values():
            self._run(roots)

    def debug_string(self):
        return "Lazy()"

    # -- the representation ---------------------------------------------------------------

    def value_dtype(self, value):
        return value.dtype

    def _spec(self, v):
        """The TensorSpec of a value (shape inference on demand, memoized)."""
        if v.value is not None:
            return tf.TensorSpec(v.value.shape, v.dtype)
        if v._spec is None:
            node = v.node
            specs = [_shape_inference.Spec(self._spec(i)) if isinstance(i, LazyValue)
                     else _shape_inference.Spec(tf.TensorSpec(i.shape, i.dtype),
                                                _shape_inference._known_value(i))  # pylint: disable=protected-access
                     for i in node.inputs]
            try:
                outs = _shape_inference._infer(node.op, specs)  # pylint: disable=protected-access
            except (ValueError, TypeError, tf.errors.OpError):
                # The shape depends on values only the computation gives (a shape
                # computed by pending ops): compute it.
                self._run([v])
                return tf.TensorSpec(v.value.shape, v.dtype)
            if not all(s.shape.is_fully_defined() for s in outs):
                # Eager tensors have known shapes (Python code relies on them): a shape
                # that depends on pending values is computed.
                self._run([v])
                return tf.TensorSpec(v.value.shape, v.dtype)
            for r, s in zip(node.outputs, outs):
                o = r()
                if o is not None:
                    o._spec = s  # pylint: disable=protected-access
        return v._spec

    def num_dims(self, value):
        rank = self._spec(value).shape.rank
        return -1 if rank is None else rank

    def dim(self, value, index):
        d = self._spec(value).shape[index]
        return -1 if d is None else int(d)

    def static_value(self, value):
        return None if value.value is None else tf.get_static_value(value.value)

    def tensor_debug_string(self, value):
        from tensorflow.python.framework import ops  # pylint: disable=import-outside-toplevel
        return ops.value_text(self._force(value))  # printing is a value request

    def copy_on(self, tensor):
        return _ready(super().copy_on(tensor))

    @staticmethod
    def needs_copy(op, index):
        # Inputs from elsewhere (a physical tensor, a Python constant) enter a node as
        # they are: wrapping each would cost more than the op it feeds.
        return False

    def copy_off(self, value, device):
        return self._force(value)

    # -- the handler ----------------------------------------------------------------------

    def execute(self, op, inputs):
        dtypes = op.output_dtypes
        if dtypes is None or _is_stateful(op.type) or any(
                v.dtype is _RESOURCE for v in inputs):
            # Runs now, in program order, on computed inputs.
            outputs = self.next.execute(op, [self._force(v) if type(v) is LazyValue else v
                                             for v in inputs])
            return [o if o.dtype is _RESOURCE else _ready(o) for o in outputs]
        node = _Node(op, [v if type(v) is not LazyValue else v if v.value is None
                          else v.value for v in inputs], _state.frames[-1].next)
        outputs = [LazyValue(node, i, d) for i, d in enumerate(dtypes)]
        node.outputs = [weakref.ref(o) for o in outputs]
        self._pending.add(node)
        return outputs

    def _force(self, value):
        """The computed tensor of `value`, running its pending subgraph if needed."""
        if value.value is None:
            self._run([value])
        return value.value

    def _run(self, values):
        # The pending nodes `values` depend on, in topological order.
        order, seen = [], set()
        stack = [(v.node, False) for v in values if v.value is None]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
                continue
            if id(node) in seen:
                continue
            seen.add(id(node))
            stack.append((node, True))
            for i in node.inputs:
                if isinstance(i, LazyValue) and i.value is None and id(i.node) not in seen:
                    stack.append((i.node, False))
        position = {id(n): k for k, n in enumerate(order)}
        external, ext_index, parts, plan = [], {}, [], []
        for node in order:
            refs = []
            for i in node.inputs:
                if isinstance(i, LazyValue):
                    if i.value is None:
                        refs.append((position[id(i.node)], i.index))
                        continue
                    i = i.value
                k = _C.tensor_key(i)
                e = ext_index.get(k)
                if e is None:
                    e = ext_index[k] = len(external)
                    external.append(i)
                refs.append((-1, e))
            parts.append((node.op.type, node.op.attrs_key(), tuple(refs)))
            plan.append((node.op, refs))
        key = (tuple(parts), tuple((t.dtype, t._shape_tuple()) for t in external))  # pylint: disable=protected-access
        entry = self._functions.get(key)
        if entry is None:
            entry = self._compile(plan, external)
            if len(self._functions) >= _CACHE_SIZE:
                self._functions.clear()
            self._functions[key] = entry
        try:
            outputs = entry.run(order[-1].next, external)
        except Exception:
            for node in order:  # a failed computation is not retried when the scope closes
                self._pending.discard(node)
            raise
        it = iter(outputs)
        for node in order:
            for r in node.outputs:
                value = next(it)
                o = r()
                if o is not None:
                    o.value = value
            node.inputs = None  # computed: release the inputs
            self._pending.discard(node)
        self.flushes += 1

    def _compile(self, plan, external):
        """A function of the external inputs returning every output of `plan`'s nodes."""
        specs = [tf.TensorSpec(t.shape, t.dtype) for t in external]

        def build(*args):
            graph = tf.compat.v1.get_default_graph()
            results = []
            for op, refs in plan:
                ins = [args[i] if p < 0 else results[p][i] for p, i in refs]
                results.append(graph.create_op(op.type, ins, attrs=op.attr_protos()).outputs)
            return [o for outs in results for o in outs]

        with _ops.init_scope():
            fn = tf.function(build, input_signature=specs,
                             autograph=False).get_concrete_function()
        self.compiled += 1
        return _replay.CompiledCall(fn)


