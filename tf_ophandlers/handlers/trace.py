"""`TraceAndExecute`: runs ops eagerly and records them into a function (RFC "Tracing
eager operations", "Tracing as a handler").

>>> import tensorflow as tf, tf_ophandlers as oh
>>> x = tf.constant([1.0, 2.0])
>>> with oh.TraceAndExecute() as trace:
...     y = tf.sin(x) * 2.0
>>> f = trace.function(y)          # a ConcreteFunction of trace.inputs, here (x,)
>>> f(tf.constant([0.0, 3.0])).numpy()
array([0.     , 0.28224], dtype=float32)

Every op in the scope runs as usual (the handler is transparent) and is recorded with
its attributes. `trace.inputs` are the tensors that entered the scope from outside, in
order of first use; Python constants created in the scope are baked into the function,
and variables read in it are captured (so the function can be saved in a SavedModel
along with them, and shown in TensorBoard's graph view: `trace.write_graph(logdir, y)`
writes it for `tensorboard --logdir logdir`, `trace.graph_def(y)` returns it).
`tf.function` calls are recorded as calls of the same function.
"""
import threading

import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.framework import ops as _ops
from tensorflow.python.util import nest

from tf_ophandlers.extend import (
    dispatch as _dispatch, errors, functions as _functions, graph_builder, OpHandler,
    representation_of, scope as _scope, tensor_key, tf_patches)

_key = tensor_key  # tensors are keyed by TensorFlow handle
_open = threading.local()  # .traces: this thread's TraceAndExecute scopes, innermost last


def _wrap_variable_accessed(original):
    def variable_accessed(variable):
        original(variable)
        if not variable.trainable:  # (trainable ones reach the scope's variable watcher)
            for trace in getattr(_open, "traces", ()):
                trace._variables.setdefault(_key(variable.handle), variable)  # pylint: disable=protected-access

    return variable_accessed


# Every variable the scope reads is captured as the variable (BatchNormalization's moving
# statistics too), so that a SavedModel maps the capture to the tracked object.
tf_patches.subscribe("resource_variable_ops.variable_accessed", "trace variable reads",
                     _wrap_variable_accessed)


class _Record:
    __slots__ = ("op", "inputs", "outputs")

    def __init__(self, op, inputs, outputs):
        self.op = op            # the Op (attributes kept by the C++ boundary)
        self.inputs = inputs    # refs: ("op", record, index) | ("in", i) | ("const", i)
        self.outputs = outputs  # the eager outputs (kept: their keys stay unique)


class TraceAndExecute(OpHandler):
    """Executes every op eagerly and records it; `function(outputs)` builds a
    ConcreteFunction of `inputs` that recomputes `outputs`.

    Examples:
        >>> x = tf.constant([1.0, 2.0])
        >>> trace = oh.TraceAndExecute()
        >>> with trace:
        ...     y = tf.square(x) + 1.0
        >>> f = trace.function(y)
        >>> f(tf.constant([3.0, 4.0])).numpy().tolist()
        [10.0, 17.0]
    """

    transparent = True
    # A tf.function call is recorded as one call of the same function.
    replays_functions = False
    TYPE_NAME = "TRACE"
    # The recorded ops, the inputs in order of first use and the variable watcher (which
    # TensorFlow keeps per thread) belong to the open scope and are kept on the instance:
    # a second thread's ops would be interleaved into the trace, its variables missed.
    one_thread_at_a_time = True

    def __init__(self):
        self.records = []
        self._entered = []        # tensors that entered the scope from outside
        self._constants = []      # Python constants created in the scope
        self._refs = {}           # tensor key -> ref
        self._variables = {}      # handle key -> tf.Variable read in the scope
        self._watcher = None
        self._depth = 0

    def debug_string(self):
        return "TraceAndExecute(%d ops)" % len(self.records)

    @property
    def inputs(self):
        """The tensors that entered the scope from outside, in order of first use (the
        arguments of `function`); variables read are captured instead."""
        return [t for t in self._entered if t.dtype != tf.resource]

    # -- scopes ---------------------------------------------------------------------------

    def scope_entered(self):
        self._depth += 1
        if self._depth == 1:
            self._watcher = pywrap_tfe.TFE_Py_VariableWatcherNew()
            tf_patches.acquire("trace variable reads")
            _dispatch.collect_python_constants(+1)  # (`_ref` asks about constants)
            _open.__dict__.setdefault("traces", []).append(self)

    def scope_exited(self):
        self._depth -= 1
        if self._depth == 0 and self._watcher is not None:
            traces = _open.__dict__.get("traces", [])
            if any(t is self for t in traces):
                traces.remove(self)
                tf_patches.release("trace variable reads")
                _dispatch.collect_python_constants(-1)
            self._harvest()
            pywrap_tfe.TFE_Py_VariableWatcherRemove(self._watcher)
            self._watcher = None

    def _harvest(self):
        if self._watcher is not None:
            for v in pywrap_tfe.TFE_Py_VariableWatcherWatchedVariables(self._watcher):
                self._variables.setdefault(_key(v.handle), v)

    # -- the handler ----------------------------------------------------------------------

    def _ref(self, tensor):
        k = _key(tensor)
        ref = self._refs.get(k)
        if ref is None:
            if _dispatch.is_python_constant(tensor):
                ref = self._refs[k] = ("const", len(self._constants))
                self._constants.append(tensor)
            else:
                ref = self._refs[k] = ("in", len(self._entered))
                self._entered.append(tensor)
        return ref

    changes_computation = False  # runs each op as it is, traced

    def execute(self, op, inputs):
        outputs = self.next.execute(op, inputs)
        refs = [self._ref(t) for t in inputs]
        index = len(self.records)
        self.records.append(_Record(op, refs, list(outputs)))
        for j, o in enumerate(outputs):
            self._refs[_key(o)] = ("op", index, j)
        return outputs

    # -- the function ---------------------------------------------------------------------

    def function(self, outputs):
        """A ConcreteFunction of the non-resource `inputs` (in order) recomputing
        `outputs` (a structure of tensors produced or used in the scope).

        Variables read in the scope are captured by reference, constants are baked in;
        every recorded op runs (stateful ones in their recorded order).
        """
        self._harvest()
        flat = nest.flatten(outputs)
        wanted = []
        for t in flat:
            if isinstance(t, tf.Variable):
                t = t.handle
            found, value = representation_of(self, t)  # a tensor of the trace's stack
            ref = self._refs.get(_key(value if found else t))
            if ref is None:
                raise ValueError(
                    "oh.TraceAndExecute.function: %r was neither computed nor used in the "
                    "traced scope" % (t,))
            wanted.append(ref)
        entered = list(self._entered)
        arg_positions = [i for i, t in enumerate(entered) if t.dtype != tf.resource]
        specs = [tf.TensorSpec(entered[i].shape, entered[i].dtype) for i in arg_positions]
        records, constants = list(self.records), list(self._constants)
        variables = dict(self._variables)
        library = _functions.function_library(
            [rec.op.type for rec in records if rec.op.output_dtypes is None])

        def build(*args):
            graph = _ops.get_default_graph()
            for fdef in library:
                _copy_function(graph, fdef)
            values = {}
            for i, a in zip(arg_positions, args):
                values[("in", i)] = a
            for i, t in enumerate(entered):
                if t.dtype == tf.resource:
                    v = variables.get(_key(t))
                    values[("in", i)] = v.handle if v is not None else t  # captured
            for i, c in enumerate(constants):
                values[("const", i)] = tf.constant(c.numpy(), dtype=c.dtype)

            def get(ref):
                value = values.get(ref)
                if value is None:
                    raise errors.HandlerError(
                        "oh.TraceAndExecute: no value for %r (a tensor of another stack?)"
                        % (ref,))
                return value

            for index, rec in enumerate(records):
                op = rec.op
                ins = [get(r) for r in rec.inputs]
                if op.output_dtypes is None:  # a tf.function call
                    outs = graph.create_op(
                        "StatefulPartitionedCall", ins,
                        dtypes=[o.dtype for o in rec.outputs],
                        attrs=_call_attrs(op.type, ins, rec.outputs)).outputs
                else:
                    outs = graph_builder.create(graph, op, ins)
                for j, o in enumerate(outs):
                    values[("op", index, j)] = o
            return nest.pack_sequence_as(outputs, [tf.identity(get(r)) for r in wanted])

        return tf.function(build, input_signature=specs, autograph=False).get_concrete_function()

    def graph_def(self, outputs):
        """The GraphDef of `function(outputs)` (for TensorBoard's graph view)."""
        return self.function(outputs).graph.as_graph_def()

    def write_graph(self, logdir, outputs):
        """Writes the graph of `function(outputs)` to an event file in `logdir` for
        TensorBoard's graph dashboard (`tensorboard --logdir logdir`, "Graphs"); returns
        the GraphDef written."""
        graph_def = self.graph_def(outputs)
        with _scope.physical():  # the summary ops are not part of anything traced
            writer = tf.summary.create_file_writer(logdir)
            try:
                with writer.as_default():
                    tf.summary.graph(graph_def)
            finally:
                writer.close()
        return graph_def


def _call_attrs(name, ins, outs):
    from tensorflow.core.framework import attr_value_pb2  # pylint: disable=import-outside-toplevel
    f = attr_value_pb2.AttrValue()
    f.func.name = name
    tin = attr_value_pb2.AttrValue()
    tin.list.type.extend([t.dtype.as_datatype_enum for t in ins])
    tout = attr_value_pb2.AttrValue()
    tout.list.type.extend([t.dtype.as_datatype_enum for t in outs])
    return {"f": f, "Tin": tin, "Tout": tout}


def _copy_function(graph, fdef):
    from tensorflow.python.client import pywrap_tf_session  # pylint: disable=import-outside-toplevel
    fn = pywrap_tf_session.TF_FunctionImportFunctionDef(fdef.SerializeToString())
    try:
        with graph._c_graph.get() as c_graph:  # pylint: disable=protected-access
            pywrap_tf_session.TF_GraphCopyFunction(c_graph, fn, None)
    finally:
        pywrap_tf_session.TF_DeleteFunction(fn)
