"""tf-ophandlers: TensorFlow transformations as composable front-end op handlers.

    import tensorflow as tf
    import tf_ophandlers as oh

    log = oh.OpLogHandler()
    with log:
        y = tf.sin(tf.constant([1.0, 2.0])) * 2.0
    [r.op_type for r in log.records]   # ['Sin', 'Mul']

Importing the package changes nothing in TensorFlow's runtime: the dispatcher device is
registered and TensorFlow's internals are patched (`oh.patches()`) when the first handler
scope opens, so devices can still be configured after ``import tf_ophandlers``.

See README.md and the documentation pages in docs/ (`make docs` builds the site).
"""
from tf_ophandlers._install_check import SUPPORTED_TENSORFLOW, check_tensorflow, load_extension

# Each raises an ImportError that says what to install or build (not a bare
# ModuleNotFoundError or a "circular import" from a checkout without the extension).
_tf = check_tensorflow()
_C = load_extension()  # after TensorFlow: the extension needs its libraries
from tf_ophandlers.core import tensor as _tensor  # noqa: E402,F401  (registers patches)
from tf_ophandlers.core import functions as _functions  # noqa: E402,F401  (the call rule)
from tf_ophandlers.core.cache import caches  # noqa: E402
from tf_ophandlers.core.errors import (  # noqa: E402
    CopyOffError, HandlerError, HandlerOutputError, PlacementError)
from tf_ophandlers.core.handler import OpHandler  # noqa: E402
from tf_ophandlers.core.op import Op  # noqa: E402
from tf_ophandlers.core.dispatch import DISPATCHER_DEVICE  # noqa: E402
from tf_ophandlers.core.scope import handler, handler_of  # noqa: E402
from tf_ophandlers.core.stack import (  # noqa: E402
    COPY_OPS, PHYSICAL, HandlerStack, OffStack, current_stack, never_copy, next_stack,
    representation_of, stack_of, tensor_key)
from tf_ophandlers.core.copies import copy_off, copy_on  # noqa: E402
from tf_ophandlers.core.functions import per_call  # noqa: E402
from tf_ophandlers.core import tf_patches as _tf_patches  # noqa: E402
from tf_ophandlers.core.tf_patches import patches  # noqa: E402
from tf_ophandlers.handlers.op_log import OpLogHandler, OpRecord  # noqa: E402
from tf_ophandlers.handlers.check_numerics import CheckNumericsHandler  # noqa: E402
from tf_ophandlers.handlers.gradient_tape import GradientTape  # noqa: E402
from tf_ophandlers.handlers import substitutes as _substitutes  # noqa: E402,F401  (the rule)
from tf_ophandlers.handlers.forward_accumulator import ForwardAccumulator  # noqa: E402
from tf_ophandlers.handlers.vectorized_map import VectorizedMap, vectorized_map  # noqa: E402
from tf_ophandlers.handlers.parallel import (  # noqa: E402
    ParallelHandler, ParallelValue, ParallelVariable)
from tf_ophandlers.handlers.mesh import Mesh  # noqa: E402
from tf_ophandlers.handlers.shape_inference import ShapeInference, eval_shape  # noqa: E402
from tf_ophandlers.handlers.trace import TraceAndExecute  # noqa: E402
from tf_ophandlers.handlers.lazy import Lazy  # noqa: E402
from tf_ophandlers.handlers.async_execution import Async  # noqa: E402
from tf_ophandlers.handlers.recompute import Recompute  # noqa: E402
from tf_ophandlers.handlers.data_format import DataFormat  # noqa: E402
from tf_ophandlers.handlers.debugger import DebuggerHandler  # noqa: E402
from tf_ophandlers import testing  # noqa: E402
from tf_ophandlers.core.native import (  # noqa: E402
    HandlerLibrary, NativeHandler, load_handler_library)
from tf_ophandlers import native  # noqa: E402  (classes load the library on first use)
from tf_ophandlers import sysconfig  # noqa: E402

__version__ = "0.1.0"

import atexit as _atexit  # noqa: E402

# At exit, callbacks must stop entering Python before the interpreter finalizes.
_atexit.register(_C.shutdown)


def install():
    """Also exposes the scope as `tf.handler` (the RFC's spelling).

    Examples:
        >>> oh.install()
        >>> with tf.handler(oh.OpHandler()):
        ...     y = tf.constant(1.0) + 1.0
        >>> float(y)
        2.0
    """
    _tf_patches.ensure("tf.handler")


_tf_patches.subscribe("tf.handler", "tf.handler", lambda absent: handler)


__all__ = [
    "OpHandler", "Op", "HandlerStack", "PHYSICAL", "DISPATCHER_DEVICE", "handler",
    "handler_of", "current_stack", "install", "copy_on", "copy_off", "OpLogHandler",
    "OpRecord", "CheckNumericsHandler", "GradientTape",
    "ForwardAccumulator", "VectorizedMap", "vectorized_map", "ParallelHandler",
    "ParallelValue", "ParallelVariable", "Mesh", "OffStack", "ShapeInference", "eval_shape", "TraceAndExecute", "Lazy", "Async",
    "Recompute", "DataFormat", "DebuggerHandler",
    "testing", "HandlerError", "PlacementError",
    "HandlerOutputError", "CopyOffError",
    # for handler authors (docs/guide.md, "The handler author's API")
    "next_stack", "stack_of", "tensor_key", "representation_of", "COPY_OPS", "patches",
    "caches", "per_call", "never_copy",
    # handlers in C++ (docs/guide.md, "Writing a handler in C++")
    "load_handler_library", "HandlerLibrary", "NativeHandler", "native", "sysconfig",
]
