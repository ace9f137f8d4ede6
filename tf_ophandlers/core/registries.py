"""Tables a handler family fills for the others, so that no handler imports another.

As JAX's rule tables (a batching rule registered by the module that defines the
primitive, read by `batching.py`), each table here is owned by this lower layer, filled
by the handler module that provides the entry and read by the ones that need it. None
of them names a shipped handler. `tf_ophandlers.extend` is the public face:

- gradient functions that accept None output gradients (`register_gradient_accepts_none`,
  read by a reverse-mode tape's backward pass);
- the package's differentiating handler classes by kind (`register_tape`, `tape_class`)
  and the ones recording right now (`recording_handlers`);
- the function that batches a Python function over a leading axis op by op
  (`register_vectorizer`, `vectorizer`).
"""
import threading

from tensorflow.python import pywrap_tfe

from tf_ophandlers.core.stack import current_stack


class _AllOutputs:
    """Contains every output index."""

    __slots__ = ()

    def __contains__(self, index):
        return True

    def __repr__(self):
        return "ALL_OUTPUTS"


#: `register_gradient_accepts_none`'s `indices` for a gradient function that accepts None
#: for every output gradient.
ALL_OUTPUTS = _AllOutputs()

_lock = threading.Lock()

# Op type -> output indices whose gradient the op's gradient function accepts as None.
# TensorFlow's tape (pywrap_tfe_src.cc, FunctionsAcceptingNoneForIndicesMap) skips
# building zeros for these; a tape here does the same.
_accepts_none = {
    "SoftmaxCrossEntropyWithLogits": (1,),
    "SparseSoftmaxCrossEntropyWithLogits": (1,),
    "FusedBatchNorm": (1, 2, 3, 4),
}


def register_gradient_accepts_none(op_type, indices=ALL_OUTPUTS):
    """Declares that the gradient function recorded for `op_type` accepts None for the
    output gradients at `indices` (a collection of ints, or `ALL_OUTPUTS`), so a
    backward pass passes None there instead of zeros. A handler that records its own op
    type on TensorFlow's tapes (`record_operation`) registers it at import. With
    `ALL_OUTPUTS`, a tape's record of the op made with a backward function keeps neither
    its outputs nor its tracked inputs (as TensorFlow's tape keeps none for
    `record_operation`): the backward function must hold what it reads."""
    if not isinstance(op_type, str):
        raise TypeError("register_gradient_accepts_none: op_type must be a string, got %r"
                        % (op_type,))
    if indices is not ALL_OUTPUTS:
        indices = tuple(indices)
        if not all(isinstance(i, int) and i >= 0 for i in indices):
            raise ValueError("register_gradient_accepts_none(%r): indices must be output "
                             "indices (ints >= 0) or ALL_OUTPUTS, got %r" % (op_type, indices))
    with _lock:
        _accepts_none[op_type] = indices


def gradient_accepts_none(op_type):
    """The output indices whose gradients `op_type`'s gradient function accepts as None
    (supports ``index in ...``; empty for an op type nobody registered)."""
    return _accepts_none.get(op_type, ())


_tapes = {}  # kind ("reverse", "forward") -> handler class


def register_tape(kind, cls):
    """Registers `cls`, a handler class that `differentiates` in `kind` mode ("reverse"
    or "forward"), as this package's differentiating handler of that kind: handlers that
    must record what they run for such differentiation (a substitute's replacement ops,
    Keras's train step in a data-parallel fit) make one with `tape_class(kind)`."""
    if kind not in ("reverse", "forward"):
        raise ValueError("register_tape: kind must be 'reverse' or 'forward', got %r" % (kind,))
    if getattr(cls, "differentiates", None) != kind:
        raise ValueError("register_tape(%r, %s): the class must declare differentiates = %r"
                         % (kind, getattr(cls, "__name__", cls), kind))
    _tapes[kind] = cls


def tape_class(kind="reverse"):
    """The handler class registered with `register_tape(kind, ...)`.

    Raises LookupError if no module registered one (its handler module is not imported).
    """
    cls = _tapes.get(kind)
    if cls is None:
        raise LookupError("tf_ophandlers: no %s-mode tape handler is registered "
                          "(register_tape)" % kind)
    return cls


def tape_name(kind="reverse"):
    """How error messages name the registered tape of `kind` (``oh.<class name>``)."""
    cls = _tapes.get(kind)
    return "oh.%s" % cls.__name__ if cls is not None else "a %s-mode tape" % kind


def recording_handlers(kind="reverse"):
    """The handlers of the current stack (inside a hook: below the running handler) that
    differentiate in `kind` mode and record now (`OpHandler.is_recording`), innermost
    first; none while TensorFlow's tape set is stopped (inside a tape's
    `stop_recording`, and during TensorFlow's own backward pass)."""
    if pywrap_tfe.TFE_Py_TapeSetIsStopped():
        return ()
    return tuple(h for h in reversed(current_stack().handlers)
                 if getattr(h, "differentiates", None) == kind and h.is_recording())


_vectorizer = [None]


def register_vectorizer(fn):
    """Registers ``fn(f, elems) -> outputs``: `f` applied to each slice of `elems` along
    axis 0, batched op by op (as `tf.vectorized_map`). A tape's Jacobian with
    ``experimental_use_pfor=True`` computes its rows with it."""
    if not callable(fn):
        raise TypeError("register_vectorizer: expected a function, got %r" % (fn,))
    _vectorizer[0] = fn


def vectorizer():
    """The function registered with `register_vectorizer`, or None."""
    return _vectorizer[0]
