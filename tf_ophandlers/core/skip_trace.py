"""TensorFlow's op fast path without its per-op Python stack capture, while a handler
scope places ops on the dispatcher.

Every generated op wrapper (gen_*_ops) calls `pywrap_tfe.TFE_Py_FastPathExecute`, which
captures the Python stack of the op for kernel error messages: about a third of
TensorFlow's own per-op time for a small op. An op placed on the dispatcher never runs as
that op: a handler records it (oh.Lazy, a tape's replay) or the dispatcher builds a new
op from its attributes for the device below, so its trace is dropped unread. While a
scope has put the dispatcher device on (`core/scope.py`), the scoped patch below makes
the function `cc/fast/fast_trace.cc`'s `skip_trace_execute`: the common op placed on the
dispatcher (tensor or Python-number inputs, only type attributes those inputs give, one
output, no tape, accumulator or op callback) is made and run as TensorFlow's fast path
does, without the capture. It also takes what TensorFlow's fast path refuses before
running anything and its generated Python fallback converts (capturing again): lists
and tuples of Python numbers (Keras's `perm`/`shape` tuples) and Keras variables,
converted as that fallback does (cc/fast/fast_convert.cc). Every other call goes to
TensorFlow's function unchanged (its values, errors and recording). TensorFlow has no
switch for the capture.
"""
from tensorflow.python import pywrap_tfe

from tf_ophandlers.core import tf_patches
from tf_ophandlers.core.fast_decision import skip_trace_execute, skip_trace_setup

NAME = "fast path without stack capture"
_fast_path_execute = pywrap_tfe.TFE_Py_FastPathExecute  # TensorFlow's function


def _wrap(fast_path_execute):
    skip_trace_setup(fast_path_execute)
    return skip_trace_execute


tf_patches.subscribe("pywrap_tfe.TFE_Py_FastPathExecute", NAME, _wrap)


def acquire():
    """One more scope that places ops on the dispatcher (reference counted)."""
    tf_patches.acquire(NAME)


def release():
    """Ends one `acquire()`; the last release restores TensorFlow's function."""
    tf_patches.release(NAME)
