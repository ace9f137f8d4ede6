"""Patches of TensorFlow's tensors, graphs, errors, ops and SavedModel code in Python
(tensorflow.python.framework, tensorflow.python.ops, tensorflow.python.saved_model, the
`tf` module). Each is one symbol (or one family); subscribers innermost first."""
from tf_ophandlers.core.tf_patches.registry import Symbol, declare

_FRAMEWORK = "tensorflow.python.framework."
_OPS = "tensorflow.python.ops."


# -- what tensors show -------------------------------------------------------------------

declare(
    "EagerTensor.device", [Symbol(_FRAMEWORK + "ops", "EagerTensor.device")],
    "the getter is a C getset with no hook. Plain tensors pay one C call (payload lookup) "
    "more.",
    [("EagerTensor.device", "the only subscriber")])

declare(
    "tensor_util.constant_value",
    [Symbol(_FRAMEWORK + "tensor_util", "constant_value"),
     Symbol("tensorflow", "get_static_value", alias=True)],
    "TensorFlow has no hook on static values; tf.get_static_value is the same function",
    [("constant_value", "the only subscriber")])

declare(
    "array_ops.size_internal", [Symbol(_OPS + "array_ops", "size_internal")],
    "TensorFlow computes an eager tf.size in Python, with no hook",
    [("size", "the only subscriber")])

declare(
    "EagerTensor.set_shape", [Symbol(_FRAMEWORK + "ops", "_EagerTensorBase.set_shape")],
    "TensorFlow has no hook on an eager tensor's set_shape. Plain tensors pay one payload "
    "lookup.",
    [("EagerTensor.set_shape", "the only subscriber")])


# -- graphs, functions, control flow ---------------------------------------------------------

declare(
    "FuncGraph._create_op_internal",
    [Symbol(_FRAMEWORK + "func_graph", "FuncGraph._create_op_internal")],
    "TensorFlow has no hook for graph-op creation. Installed only while a replay traces.",
    [("FuncGraph._create_op_internal", "the only subscriber")])

declare(
    "cond._eager_cond_implementation", [Symbol(_OPS + "cond", "_eager_cond_implementation")],
    "TensorFlow has no hook for eager control flow",
    [("eager control flow", "the only subscriber")])

declare(
    "control_flow_switch_case._indexed_case_helper",
    [Symbol(_OPS + "control_flow_switch_case", "_indexed_case_helper")],
    "TensorFlow has no hook for eager control flow",
    [("eager control flow", "the only subscriber")])

declare(
    "while_loop.while_loop", [Symbol(_OPS + "while_loop", "while_loop")],
    "TensorFlow has no hook for eager control flow",
    [("eager control flow", "the only subscriber")])

declare(
    "gradients_util.PossibleTapeGradientTypes",
    [Symbol(_OPS + "gradients_util", "PossibleTapeGradientTypes")],
    "a function call asks which tapes may record it before it runs; a handler tape "
    "watching an argument must make the answer positive",
    [("tape hooks", "the only subscriber")])

declare(
    "resource_variable_ops.variable_accessed",
    [Symbol(_OPS + "resource_variable_ops", "variable_accessed")],
    "TensorFlow reports only trainable variables to variable watchers, as a FuncGraph's "
    "watch_variable does for every variable",
    [("trace variable reads", "the only subscriber")])

declare(
    "save._fill_meta_graph_def",
    [Symbol("tensorflow.python.saved_model.save", "_fill_meta_graph_def")],
    "TensorFlow has no hook to inspect what is saved",
    [("save._fill_meta_graph_def", "the only subscriber")])


# -- errors -------------------------------------------------------------------------------

declare(
    "OpError.__new__", [Symbol(_FRAMEWORK + "errors", "OpError.__new__")],
    "EagerTensor's C++ accessors (shape, len, repr) instantiate a registered tf.errors "
    "class from a status in C++, with no Python conversion to hook",
    [("status_to_exception", "the only subscriber")])


def _error_inits():
    """Each tf.errors class's own `__init__` (one family: one wrapper serves all)."""
    from tensorflow.python.framework import errors  # pylint: disable=import-outside-toplevel
    seen = set()
    for name, cls in sorted(vars(errors).items()):
        if (isinstance(cls, type) and issubclass(cls, errors.OpError)
                and "__init__" in cls.__dict__ and cls not in seen):
            seen.add(cls)
            yield Symbol(_FRAMEWORK + "errors", name + ".__init__")


declare(
    "tf.errors classes' __init__", _error_inits,
    "a handler's tf.errors exception returned by the patched __new__ is initialized again "
    "by Python with the status message; TensorFlow has no hook there",
    [("status_to_exception", "the only subscriber")])


# -- the tf module --------------------------------------------------------------------------

declare(
    "tf.handler", [Symbol("tensorflow", "handler")],
    "the RFC spells the scope tf.handler; TensorFlow has no such attribute (added by "
    "oh.install(), removed by the uninstall)",
    [("tf.handler", "the only subscriber")])
