"""Patches of TensorFlow's eager runtime in Python (tensorflow.python.eager, pywrap_tfe).

Each is one symbol. Subscribers are listed innermost first: the first wraps TensorFlow's
object, the next wraps that, and the last is what TensorFlow's callers reach.
"""
from tf_ophandlers.core.tf_patches.registry import Registration, Symbol, declare

_EAGER = "tensorflow.python.eager."
_PYWRAP = "tensorflow.python.pywrap_tfe"


# -- gradient records made from Python --------------------------------------------------

declare(
    "record.record_operation", [Symbol(_EAGER + "record", "record_operation")],
    "the record of a gradient made from Python (tf.custom_gradient, tf.recompute_grad, "
    "tf.function calls) reaches only TensorFlow's tape set; TensorFlow has no hook on it",
    [("function call records",
      "innermost: it changes the record TensorFlow's own tapes get (a replayed call's "
      "backward runs on the call's stack) and then tells the record subscribers of "
      "core/recording.py, after TensorFlow's tapes have it"),
     ("tape hooks",
      "around the call records: it asks whether the record is of a replayed call "
      "before the call records consume that note, lets TensorFlow's tapes record first "
      "and then records on the handler tapes of the scope"),
     ("recompute graph records",
      "outermost: inside a recompute window in a traced function a record is "
      "deferred as a whole, and made at the window's flush through everything below "
      "(TensorFlow's tapes and handler tapes get it then, once)")])

declare(
    "record.record_operation_backprop_only",
    [Symbol(_EAGER + "record", "record_operation_backprop_only")],
    "TensorFlow's record of a function call whose arguments carry forward-mode tangents "
    "(ConcreteFunction) reaches only its tape set",
    [("tape hooks", "records on the handler tapes of the scope after TensorFlow's "
      "tapes; its identity links go to TensorFlow's tapes only (what it wraps)"),
     ("recompute graph records", "outermost, as for record_operation")])

declare(
    "record.record_operation_forwardprop_only",
    [Symbol(_EAGER + "record", "record_operation_forwardprop_only")],
    "a forward-only record inside a recompute window of a traced function is deferred "
    "with the others",
    [("recompute graph records", "the only subscriber")])

declare(
    "record.could_possibly_record", [Symbol(_EAGER + "record", "could_possibly_record")],
    "TensorFlow skips building a record when none of its tapes is active; an active "
    "a handler tape needs the record too",
    [("tape hooks", "the only subscriber")])

declare(
    "execute.record_gradient", [Symbol(_EAGER + "execute", "record_gradient")],
    "an op's gradient record while tracing inside a recompute window is deferred to "
    "the window's exit; TensorFlow has no hook listing the records a traced op makes",
    [("recompute graph records", "the only subscriber")])


# -- executing ops and functions --------------------------------------------------------

declare(
    "execute.quick_execute",
    [Symbol(_EAGER + "execute", "quick_execute"), Symbol(_EAGER + "execute", "execute", alias=True)],
    "TFE_Py_Execute raises the typed OpError itself, and a ConcreteFunction's call "
    "reaches the dispatcher only through TensorFlow's custom-device execute; "
    "`execute.execute` is the same function unless op callbacks are on (TensorFlow "
    "resets it to quick_execute when they go, and execute_with_callbacks calls "
    "quick_execute by name)",
    [("status_to_exception",
      "innermost: it converts the statuses of TensorFlow's own execution; the scope "
      "call's replay raises Python exceptions, which need no conversion"),
     ("scope_function_call",
      "outermost: a function call placed by a handler scope on physical arguments is "
      "replayed before anything else runs")])

declare(
    "execute.execute_with_cancellation",
    [Symbol(_EAGER + "execute", "execute_with_cancellation")],
    "TFE_Py_ExecuteCancelable raises the typed OpError itself",
    [("status_to_exception", "the only subscriber")])

declare(
    "core._status_to_exception", [Symbol(_EAGER + "core", "_status_to_exception")],
    "TensorFlow has no hook for status-to-exception conversion",
    [("status_to_exception", "the only subscriber")])

declare(
    "_NotOkStatusException.__new__",
    [Symbol(_EAGER + "core", "_NotOkStatusException.__new__")],
    "EagerTensor's C++ accessors (shape, repr) raise this class from a status in C++",
    [("status_to_exception", "the only subscriber")])

declare(
    "pywrap_tfe.TFE_ClearScalarCache", [Symbol(_PYWRAP, "TFE_ClearScalarCache")],
    "every clear of TensorFlow's scalar cache (Context._clear_caches, _reset_context) goes "
    "through this attribute; TensorFlow has no callback for the clear",
    [("TFE_ClearScalarCache", "the only subscriber")])

declare(
    "pywrap_tfe.TFE_Py_FastPathExecute", [Symbol(_PYWRAP, "TFE_Py_FastPathExecute")],
    "every generated op wrapper captures the Python stack of the op (for kernel error "
    "messages); TensorFlow has no switch for it",
    [("fast path without stack capture", "the only subscriber")])


# -- contexts, functions, tapes --------------------------------------------------------

declare(
    "Context.device", [Symbol(_EAGER + "context", "Context.device")],
    "TensorFlow has no hook for device scopes",
    [("Context.device", "the only subscriber")])

declare(
    "Context.remove_function", [Symbol(_EAGER + "context", "Context.remove_function")],
    "TensorFlow has no callback for a function leaving the eager context (a dropped "
    "tf.function)",
    [("released functions", "the only subscriber")])

declare(
    "tracing_compilation._create_concrete_function",
    [Symbol(_EAGER + "polymorphic_function.tracing_compilation", "_create_concrete_function")],
    "a function call reaches a handler as an op named after its traced function; "
    "TensorFlow keeps no link from it to the Python function it traced",
    [("traced python functions", "the only subscriber")])

declare(
    "imperative_grad.imperative_grad", [Symbol(_EAGER + "imperative_grad", "imperative_grad")],
    "TensorFlow's tape has no hook on its results",
    [("source gradients", "the only subscriber")])

declare(
    "forwardprop_util.push_forwardprop_state",
    [Symbol(_EAGER + "forwardprop_util", "push_forwardprop_state")],
    "TensorFlow's accumulators resume recording inside it while they compute a JVP",
    [("forwardprop state", "the only subscriber")])

for _method in ("gradient", "__enter__", "__exit__"):
    declare(
        "GradientTape." + _method, [Symbol(_EAGER + "backprop", "GradientTape." + _method)],
        "inside a recompute scope of a traced function (a Keras fit step traced in an "
        "eager scope), tf.GradientTape's gradient refuses sources whose uses a segment "
        "hides, and a tape scope opened while tracing opens a window: the step's code has "
        "no Recompute scope of its own",
        [("recompute graph records", "the only subscriber")])


def _gradient_function():
    from tensorflow.python.eager import backprop  # pylint: disable=import-outside-toplevel
    return backprop._gradient_function  # pylint: disable=protected-access


def _register_gradient_function(fn):
    from tensorflow.python import pywrap_tfe  # pylint: disable=import-outside-toplevel
    pywrap_tfe.TFE_Py_RegisterGradientFunction(fn)


def _jvp_function():
    from tensorflow.python.eager import forwardprop  # pylint: disable=import-outside-toplevel
    return forwardprop._jvp_dispatch  # pylint: disable=protected-access


def _register_jvp_function(fn):
    from tensorflow.python import pywrap_tfe  # pylint: disable=import-outside-toplevel
    pywrap_tfe.TFE_Py_RegisterJVPFunction(fn)


declare(
    "registered gradient function",
    [Registration("pywrap_tfe.TFE_Py_RegisterGradientFunction (backprop._gradient_function)",
                  _gradient_function, _register_gradient_function)],
    "TensorFlow's eager tapes call the one gradient function registered in C; TensorFlow "
    "offers no other hook on the gradient of a recorded op",
    [("substitute gradients", "the only subscriber")])

declare(
    "registered JVP function",
    [Registration("pywrap_tfe.TFE_Py_RegisterJVPFunction (forwardprop._jvp_dispatch)",
                  _jvp_function, _register_jvp_function)],
    "TensorFlow's forward accumulators call the one JVP function registered in C",
    [("substitute gradients", "the only subscriber")])
