"""`oh.testing`: a conformance kit for handler authors.

Runs a corpus of op programs (elementwise, linear algebra, control flow, variables,
functions, Keras layers) under a handler and under plain TensorFlow, and checks the RFC's
contracts: every output has the dtype and shape the op promises (and the same value, for
handlers that keep values), CopyOn is linear, copies round-trip, and the handler is freed
once its scope and tensors are gone.

>>> import tf_ophandlers as oh
>>> report = oh.testing.check_handler(oh.OpLogHandler)
>>> report.failures
[]

Pass a factory (a new handler per program). Handlers whose tensors cannot be copied off
(a parallel handler) or that change values (a quantizer) say so with `values=False` or
`copy_off=False`; shape and dtype are then still checked.
"""
import gc
import weakref

import numpy as np
import tensorflow as tf

from tf_ophandlers.core import copies as _copies
from tf_ophandlers.core import errors as _errors
from tf_ophandlers.core import scope as _scope


class ConformanceError(AssertionError):
    """A handler broke a contract; the message names the check and the program."""


def _rng():
    return np.random.default_rng(0)


def _program_inputs():
    r = _rng()
    return {
        "x": tf.constant(r.standard_normal((3, 4)).astype(np.float32)),
        "y": tf.constant(r.standard_normal((4, 2)).astype(np.float32)),
        "img": tf.constant(r.standard_normal((1, 6, 6, 2)).astype(np.float32)),
        "seq": tf.constant(r.standard_normal((2, 5, 3)).astype(np.float32)),
    }


def _keras(name):
    import keras  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(0)
    if name == "dense":
        layer = keras.layers.Dense(5, activation="tanh")
        layer.build((None, 4))
    elif name == "conv":
        layer = keras.Sequential([keras.Input((6, 6, 2)), keras.layers.Conv2D(3, 3),
                                  keras.layers.MaxPooling2D()])
    else:
        layer = keras.Sequential([keras.Input((5, 3)), keras.layers.LSTM(4)])
    return layer


_corpus = []


def _programs():
    """The corpus, built once per process (its Keras layers, variable and function)."""
    if not _corpus:
        _corpus.append(_build_programs())
    return _corpus[0]


def _build_programs():
    dense, conv, lstm = _keras("dense"), _keras("conv"), _keras("lstm")
    variable = tf.Variable(tf.ones([4, 2]))
    function = tf.function(lambda a, b: tf.nn.relu(a @ b))

    @tf.function
    def function_with_control_flow(a):
        # Replayed through handlers that replay functions (core/functions).
        c = tf.cond(tf.reduce_sum(a) > 0, lambda: a * 2., lambda: tf.sin(a))
        return tf.while_loop(lambda k, v: k < 2, lambda k, v: (k + 1, v * 0.5 + c),
                             (tf.constant(0), a))[1]

    def with_variable(i):
        local = tf.Variable(tf.ones([2]))
        local.assign_add(tf.reduce_sum(i["x"], 0)[:2])
        return local.read_value() + tf.reduce_sum(i["x"] @ variable)

    return {
        "elementwise": lambda i: tf.tanh(i["x"]) * tf.exp(-i["x"] * i["x"]) + 1.,
        "integer_and_bool": lambda i: (tf.cast(i["x"] > 0, tf.int32) * 3, tf.argmax(i["x"], 1)),
        "linear_algebra": lambda i: (tf.matmul(i["x"], i["y"]),
                                     tf.linalg.inv(i["y"][:2] + 3. * tf.eye(2))),
        "reductions_and_reshapes": lambda i: (tf.reduce_sum(i["x"], 0),
                                              tf.transpose(tf.reshape(i["x"], [6, 2])),
                                              tf.concat([i["x"], i["x"]], 1)[:, 3:5]),
        "multiple_outputs": lambda i: tf.split(i["x"], 2, axis=1) + list(tf.nn.moments(i["x"], [0])),
        "control_flow": lambda i: tf.while_loop(
            lambda k, v: k < 3, lambda k, v: (k + 1, tf.sin(v) + v), (tf.constant(0), i["x"]))[1]
            + tf.cond(tf.constant(True), lambda: i["x"] * 2., lambda: i["x"]),
        "variables": with_variable,
        "function_call": lambda i: function(i["x"], i["y"]),
        "function_with_control_flow": lambda i: function_with_control_flow(i["x"]),
        "keras_dense": lambda i: dense(i["x"]),
        "keras_conv": lambda i: conv(i["img"]),
        "keras_lstm": lambda i: lstm(i["seq"]),
    }


class Report:
    """What `check_handler` found: `checks` run and `failures` (strings)."""

    def __init__(self):
        self.checks = []
        self.failures = []

    def check(self, name, fn):
        self.checks.append(name)
        try:
            fn()
        except ConformanceError as e:
            self.failures.append("%s: %s" % (name, e))
        except Exception as e:  # pylint: disable=broad-except
            self.failures.append("%s: %s: %s" % (name, type(e).__name__, e))

    def __repr__(self):
        return "<Report %d checks, %d failures>" % (len(self.checks), len(self.failures))


def _value(t):
    try:
        return np.asarray(t)
    except _errors.CopyOffError:
        return None


def _compare(name, got, ref, values, atol):
    got_flat, ref_flat = tf.nest.flatten(got), tf.nest.flatten(ref)
    if len(got_flat) != len(ref_flat):
        raise ConformanceError("%s: %d outputs, plain TensorFlow gives %d"
                               % (name, len(got_flat), len(ref_flat)))
    for k, (g, r) in enumerate(zip(got_flat, ref_flat)):
        if g.dtype != r.dtype:
            raise ConformanceError("%s: output %d has dtype %s, the op promises %s"
                                   % (name, k, g.dtype.name, r.dtype.name))
        if not g.shape.is_compatible_with(r.shape):
            raise ConformanceError("%s: output %d has shape %s, the op promises %s"
                                   % (name, k, g.shape, r.shape))
        if values:
            v = _value(g)
            if v is None:
                raise ConformanceError("%s: output %d cannot be copied off (pass "
                                       "copy_off=False if the handler refuses copies)"
                                       % (name, k))
            if not np.allclose(v, r.numpy(), atol=atol, rtol=atol):
                raise ConformanceError("%s: output %d differs from plain TensorFlow by %g"
                                       % (name, k, np.max(np.abs(v - r.numpy()))))


def check_handler(make_handler, *, values=True, copy_off=True, programs=None, atol=1e-5,
                  raise_on_failure=False):
    """Runs the conformance corpus under handlers made by `make_handler()`.

    Returns a `Report`; with ``raise_on_failure=True`` raises `ConformanceError` listing
    the failures. `programs` selects corpus entries by name (default: all).
    """
    values = values and copy_off
    report = Report()
    inputs = _program_inputs()
    corpus = _programs()
    for name in programs or sorted(corpus):
        fn = corpus[name]

        def run_program(name=name, fn=fn):
            ref = fn(inputs)
            with make_handler():
                got = fn(inputs)
            _compare(name, got, ref, values, atol)

        report.check("program %s" % name, run_program)

    x, y = inputs["x"], inputs["x"][::-1]

    def copy_on_is_linear():
        combined = 2. * x - 3. * y  # computed outside: CopyOn(2x - 3y) = 2 CopyOn(x) - 3 CopyOn(y)
        with make_handler():
            lhs = _copies.copy_on(combined)
            rhs = 2. * _copies.copy_on(x) - 3. * _copies.copy_on(y)
            diff = lhs - rhs
        _compare("CopyOn linearity", diff, tf.zeros_like(x), values, atol)

    def copies_round_trip():
        if not copy_off:
            return
        with make_handler():
            on = _copies.copy_on(x)
        back = _copies.copy_off(on)
        _compare("CopyOn then CopyOff", back, x, True, atol)
        if _scope.handler_of(back) is not None:
            raise ConformanceError("CopyOff left the tensor on %s" % _scope.handler_of(back))

    def lifetime_ends():
        handler = make_handler()
        ref = weakref.ref(handler)
        transient = handler.transient
        with handler:
            out = tf.sin(x) * 2.
            v = tf.Variable(1.)
            v.assign_add(1.)
        del out, handler
        gc.collect()
        if transient and ref() is not None:
            raise ConformanceError("a transient handler is kept alive by a variable created "
                                   "in its scope (RFC: resource handles stay on the next "
                                   "stack)")
        del v
        gc.collect()
        if ref() is not None:
            raise ConformanceError("the handler is still alive after its scope, tensors and "
                                   "variables are gone (a reference cycle, or a registry?)")

    report.check("CopyOn is linear", copy_on_is_linear)
    report.check("copies round-trip", copies_round_trip)
    report.check("lifetime ends", lifetime_ends)
    if raise_on_failure and report.failures:
        raise ConformanceError("%d of %d checks failed:\n  %s" % (
            len(report.failures), len(report.checks), "\n  ".join(report.failures)))
    return report
