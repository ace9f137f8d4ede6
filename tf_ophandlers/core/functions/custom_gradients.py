"""Gradient overrides (`tf.custom_gradient`) of replayed function nodes.

A node a `tf.custom_gradient` made carries ``_gradient_op_type``: its gradient is the
Python function registered under that name, not its type's (IdentityN passes gradients
through). A replay keeps the override (`Op.gradient_op_type`), so the tapes and
accumulators above and TensorFlow's gradient of the replayed function use it.

The registered function is a closure of the trace: it may read tensors of the traced
function (``dy * tf.cos(x)``), which do not exist in the graph a replay builds. Such a
gradient cannot run there; rather than the type's gradient (a silently wrong result),
the replayed node gets a gradient that raises a clear error when it is asked for.
Whether a gradient reads traced tensors is probed once per override by tracing it in a
scratch graph (bounded cache).
"""
from tensorflow.python.eager import backprop as _backprop
from tensorflow.python.framework import func_graph as _func_graph
from tensorflow.python.framework import ops as _ops
from tensorflow.python.ops import array_ops as _array_ops

from tf_ophandlers.core import errors
from tf_ophandlers.core.cache import BoundedCache

_probed = BoundedCache("functions.custom_gradients", 1024)  # override -> replayable name


def _reads_traced_tensors(node, grad_fn):
    """Whether `grad_fn` (the node's override), traced in a graph of its own, reads
    tensors of a graph being traced (it captures a symbolic tensor, or TensorFlow
    refuses one as out of scope)."""
    with _ops.init_scope():  # a graph whose outer graphs hold no traced tensors
        graph = _func_graph.FuncGraph("oh_custom_gradient_probe")
    with graph.as_default():
        def like(tensors):
            return [_array_ops.placeholder(t.dtype, t.shape) for t in tensors]
        # The op as the tapes pass it (their inputs and outputs, not the traced node's):
        # an override registered for any op may read `op.inputs`.
        op = _backprop._MockOp(  # pylint: disable=protected-access
            (), like(node.inputs), like(node.outputs), node.type, None)
        try:
            grad_fn(op, *like(node.outputs))
        except (TypeError, ValueError) as e:
            text = str(e)
            return "out of scope" in text or "must be from the same graph" in text
        except Exception:  # pylint: disable=broad-except
            return False  # its own error: raised where the gradient really runs
    return any(not isinstance(c, _ops.EagerTensor) for c in graph.external_captures)


def replayable_gradient(node, override):
    """The gradient name a replayed copy of graph node `node` (override `override`)
    carries: `override` itself, or the name of a gradient that raises a HandlerError
    saying why the override cannot run in a replay."""
    got = _probed.get(override)
    if got is not None:
        return got
    try:
        grad_fn = _ops._gradient_registry.lookup(override)  # pylint: disable=protected-access
    except LookupError:
        grad_fn = None
    name = override
    if grad_fn is not None and _reads_traced_tensors(node, grad_fn):
        name = "OhUnreplayable_" + override
        message = (
            "tf_ophandlers: op %s (node %s of function %s) has a tf.custom_gradient (%s) "
            "whose gradient function reads tensors of the traced function; the function "
            "was replayed through handlers, where those tensors do not exist, so its "
            "gradient cannot be computed there (TensorFlow's gradient of the op's type "
            "would be silently wrong). Compute what the gradient needs from its "
            "arguments only, or call the function outside the scope of the handler that "
            "replays it." % (node.type, node.name, node.graph.name, override))

        def unreplayable(op, *grads):  # pylint: disable=unused-argument
            raise errors.HandlerError(message)
        try:
            _ops.RegisterGradient(name)(unreplayable)
        except KeyError:  # registered by an earlier probe whose entry the cache dropped
            pass
    _probed[override] = name
    return name
