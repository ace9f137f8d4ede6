"""`oh.native`: the package's own handlers written in C++ (cc/native/native_handlers.cc), built
only against the public C ABI (cc/include/tf_ophandlers/handler.h) into the handler
library ``tf_ophandlers/_native_handlers*.so``, loaded on first use.

>>> import tensorflow as tf, tf_ophandlers as oh
>>> counter = oh.native.OpCounter()
>>> with counter:
...     y = tf.sin(tf.constant([1.0, 2.0])) * 2.0
>>> counter.counts
{'Mul': 1, 'Sin': 1}
>>> with oh.native.PassThrough():
...     float(tf.add(1.0, 2.0))
3.0

Both run every eager op from the dispatcher's C++ callback without a Python frame, so
they cost little more than plain eager execution (docs/benchmarks.md).
"""
import glob
import os

from tf_ophandlers.core.native import load_handler_library

_classes = {}


def library():
    """The package's own `HandlerLibrary`."""
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_native_handlers*.so")))
    if not found:
        raise ImportError(
            "tf_ophandlers: the native handler library _native_handlers*.so is not built "
            "(run `python setup.py build_ext --inplace` or `pip install .`)")
    return load_handler_library(found[0])


def _op_counter_class(base):
    def counts(self):
        """op type -> number of times this counter executed it (a new dict, sorted by
        op type)."""
        text = self.query("counts").decode()
        result = {}
        for line in text.splitlines():
            op_type, _, n = line.rpartition("\t")
            result[op_type] = int(n)
        return dict(sorted(result.items()))

    def total(self):
        """The number of ops executed."""
        return int(self.query("total"))

    return type("OpCounter", (base,), {
        "__doc__": (
            "Counts the ops it executes, by type, in C++ (the cheap per-op profiler).\n\n"
            "`counts` (op type -> count) equals what `oh.OpLogHandler` records for the "
            "same program (once per replay of a function, like OpLogHandler's default).\n\n"
            ">>> counter = oh.native.OpCounter()\n"
            ">>> with counter:\n"
            "...     _ = tf.sin(tf.constant(1.0))\n"
            ">>> counter.counts\n{'Sin': 1}\n"),
        "__module__": __name__,
        "counts": property(counts),
        "total": property(total),
    })


def __getattr__(name):
    if name not in ("PassThrough", "OpCounter"):
        raise AttributeError("module tf_ophandlers.native has no attribute %r" % name)
    cls = _classes.get(name)
    if cls is None:
        base = library().handler_types()[name]
        cls = _op_counter_class(base) if name == "OpCounter" else base
        cls.__module__ = __name__
        cls.changes_computation = False  # both run every op as it is
        _classes[name] = cls
    return cls


__all__ = ["PassThrough", "OpCounter", "library"]
