"""Hooks that raise or return bad values.

An exception raised by a handler hook reaches the user as the same object (type and
message), whatever its message or its __str__ do and whichever TensorFlow accessor called
the hook; it is not left behind in the error stash. A hook result the C++ boundary cannot
use is an oh.HandlerOutputError naming the handler, the hook and the op, never an
unrelated TensorFlow error, a crash or a silently wrong shape.
"""
import asyncio
import gc
import textwrap
import warnings

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers.core import errors as oh_errors
from conftest import assert_close
from python_process import run_python



class Box:
    """A representation that is not a tensor: shape questions go to the hooks."""

    def __init__(self, tensor):
        self.tensor = tensor


class BoxHandler(oh.OpHandler):
    """Keeps each tensor in a Box; `fail` maps a hook name to the exception it raises,
    `returns` maps a hook name to the value it returns instead of the right one."""

    def __init__(self, fail=None, returns=None):
        self.fail = fail or {}
        self.returns = returns or {}

    def _hook(self, name, right):
        if name in self.fail:
            raise self.fail[name]
        return self.returns.get(name, right)

    def value_dtype(self, value):
        return self._hook("value_dtype", value.tensor.dtype)

    def num_dims(self, value):
        return self._hook("num_dims", value.tensor.shape.rank)

    def dim(self, value, index):
        return self._hook("dim", value.tensor.shape[index])

    def tensor_debug_string(self, value):
        return self._hook("tensor_debug_string", "Box(%s)" % value.tensor.numpy())

    def execute(self, op, inputs):
        if "execute" in self.fail:
            raise self.fail["execute"]
        values = [v.tensor if isinstance(v, Box) else v for v in inputs]
        return [Box(o) for o in self.next.execute(op, values)]

    def copy_off(self, value, device):
        return value.tensor


class MyError(Exception):
    pass


class UnprintableError(Exception):
    def __str__(self):
        raise RuntimeError("__str__ fails")


def _exceptions():
    return [
        ("plain", lambda: MyError("boom")),
        ("keyboard_interrupt", lambda: KeyboardInterrupt("stop")),
        ("lone_surrogate", lambda: MyError("bad \udc80 text")),
        ("failing_str", UnprintableError),
        ("marker_text", lambda: MyError("see [tf_ophandlers#1] and [tf_ophandlers#2]")),
        ("tf_error", lambda: tf.errors.NotFoundError(None, None, "gone")),
    ]


ACCESSORS = {
    "shape": lambda t: t.shape,
    "len_shape": lambda t: len(t.shape),
    "ndim": lambda t: t.ndim,
    "repr": repr,
    "str": str,
    "format": lambda t: "{}".format(t),
}

# Which accessors reach which hook (dim is asked for each axis, after num_dims).
HOOK_ACCESSORS = {
    "num_dims": ["shape", "len_shape", "ndim", "repr", "str"],
    "dim": ["shape", "len_shape", "repr", "str"],
    "tensor_debug_string": ["repr", "str", "format"],
}

CASES = [(hook, acc, name, make) for hook, accs in HOOK_ACCESSORS.items() for acc in accs
         for name, make in _exceptions()]


def _stashed(exc):
    return any(entry[0] is exc for entry in list(oh_errors._stash.values()))  # pylint: disable=protected-access


@pytest.mark.parametrize("hook,accessor,name,make", CASES,
                         ids=["%s-%s-%s" % c[:3] for c in CASES])
def test_hook_exception_reaches_the_user_unchanged(hook, accessor, name, make):
    exc = make()
    x = tf.constant([1.0, 2.0])
    with BoxHandler(fail={hook: exc}):
        t = x * 2.0
    with pytest.raises(type(exc)) as info:
        ACCESSORS[accessor](t)
    assert info.value is exc
    assert type(info.value) is type(exc)
    assert info.value.args == exc.args
    assert not _stashed(exc)
    # The value itself is untouched: the same as plain TensorFlow's.
    assert_close(t.numpy(), (x * 2.0).numpy())


@pytest.mark.parametrize("name,make", _exceptions(), ids=[n for n, _ in _exceptions()])
def test_execute_exception_reaches_the_user_unchanged(name, make):
    exc = make()
    with pytest.raises(type(exc)) as info:
        with BoxHandler(fail={"execute": exc}):
            tf.sin(tf.constant([1.0]))
    assert info.value is exc
    assert not _stashed(exc)


def test_hook_exception_inside_an_except_block_keeps_its_identity():
    exc = MyError("inner")
    with BoxHandler(fail={"num_dims": exc}):
        t = tf.constant([1.0]) * 2.0
    try:
        raise ValueError("being handled")
    except ValueError:
        with pytest.raises(MyError) as info:
            t.shape  # pylint: disable=pointless-statement
    assert info.value is exc
    assert not _stashed(exc)


def test_working_hooks_match_plain_tensorflow():
    x = tf.constant([[1.0, 2.0, 3.0]])
    with BoxHandler():
        t = tf.sin(x)
    ref = tf.sin(x)
    assert t.shape == ref.shape and t.dtype == ref.dtype
    assert len(t) == len(ref)
    assert "Box(" in repr(t)
    assert_close(t.numpy(), ref.numpy())


# ---- bad returns -------------------------------------------------------

def _raises_output_error(fn, *words):
    with pytest.raises(oh.HandlerOutputError) as info:
        fn()
    text = str(info.value)
    for w in words:
        assert w in text, (w, text)
    return info.value


class Returns(oh.OpHandler):
    """execute returns make(outputs of the next stack)."""

    def __init__(self, make):
        self.make = make

    def execute(self, op, inputs):
        return self.make(self.next.execute(op, inputs))


@pytest.mark.parametrize("make,words", [
    (lambda outs: [o.numpy() for o in outs], ["numpy.ndarray", "not a tf.DType"]),
    (lambda outs: outs[0], ["EagerTensor", "list"]),
    (lambda outs: 3, ["int", "list"]),
    (lambda outs: (o for o in outs), ["generator", "list"]),
], ids=["numpy", "bare_tensor", "int", "generator"])
def test_bad_execute_return_is_a_handler_output_error(make, words):
    def run():
        with Returns(make):
            tf.sin(tf.constant([0.5]))  # shape [1]: a bare tensor iterates to one row

    _raises_output_error(run, "Returns()", "execute", "op Sin", *words)
    # The same op under a correct handler gives plain TensorFlow's result.
    with Returns(list):
        got = tf.sin(tf.constant([0.5]))
    ref = tf.sin(tf.constant([0.5]))
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert_close(got, ref)


def test_generator_execute_is_closed_not_run_later():
    ran = []

    class Gen(oh.OpHandler):
        def execute(self, op, inputs):
            ran.append("start")
            yield from self.next.execute(op, inputs)
            ran.append("end")  # pragma: no cover

    _raises_output_error(lambda: _run_in(Gen(), lambda: tf.sin(tf.constant([0.5]))),
                         "Gen()", "execute", "generator", "op Sin")
    assert "end" not in ran


def test_coroutine_execute_is_an_error_without_a_never_awaited_warning():
    class Coro(oh.OpHandler):
        async def execute(self, op, inputs):  # pylint: disable=invalid-overridden-method
            await asyncio.sleep(0)
            return self.next.execute(op, inputs)  # pragma: no cover

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _raises_output_error(lambda: _run_in(Coro(), lambda: tf.sin(tf.constant([0.5]))),
                             "Coro()", "execute", "coroutine", "op Sin")
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]


def _run_in(handler, fn):
    with handler:
        return fn()


@pytest.mark.parametrize("value,words", [
    (2 ** 40, ["1099511627776"]),
    (2 ** 31 + 1, ["2147483649"]),
    (255, ["255"]),
    ("2", ["'2'", "str"]),
    (1.0, ["1.0", "float"]),
    (True, ["True", "bool"]),
    (None, ["None"]),
], ids=["2**40", "2**31+1", "255", "str", "float", "bool", "None"])
def test_bad_num_dims_is_a_handler_output_error(value, words):
    with BoxHandler(returns={"num_dims": value}):
        t = tf.constant([[1.0, 2.0]]) * 2.0
    for accessor in (lambda: t.shape, lambda: len(t.shape), lambda: t.ndim):
        _raises_output_error(accessor, "BoxHandler()", "num_dims", "op Mul", *words)


def test_num_dims_from_numpy_int_is_accepted():
    with BoxHandler(returns={"num_dims": np.int64(2)}):
        t = tf.constant([[1.0, 2.0]]) * 2.0
    ref = tf.constant([[1.0, 2.0]]) * 2.0
    assert t.shape == ref.shape


@pytest.mark.parametrize("value,words", [
    ("2", ["'2'", "str"]),
    (2.5, ["2.5", "float"]),
    (None, ["None"]),
    (-5, ["-5"]),
    (2 ** 70, [str(2 ** 70)]),
    (False, ["False", "bool"]),
], ids=["str", "float", "None", "-5", "2**70", "bool"])
def test_bad_dim_is_a_handler_output_error(value, words):
    with BoxHandler(returns={"dim": value}):
        t = tf.constant([[1.0, 2.0]]) * 2.0
    for accessor in (lambda: t.shape, lambda: len(t.shape)):
        _raises_output_error(accessor, "BoxHandler()", "dim", "op Mul", *words)


def test_tensor_debug_string_returning_a_non_str_is_a_handler_output_error():
    with BoxHandler(returns={"tensor_debug_string": 42}):
        t = tf.constant([1.0]) * 2.0
    _raises_output_error(lambda: repr(t), "BoxHandler()", "tensor_debug_string", "42")


class FakeDType:
    as_datatype_enum = 9999


@pytest.mark.parametrize("value,words", [
    (FakeDType(), ["9999", "not a TensorFlow dtype"]),
    (np.dtype("float32"), ["not a tf.DType"]),
], ids=["enum_9999", "numpy_dtype"])
def test_bad_value_dtype_is_a_handler_output_error(value, words):
    def run():
        with BoxHandler(returns={"value_dtype": value}):
            tf.constant([1.0]) * 2.0

    _raises_output_error(run, "BoxHandler()", "op Mul", *words)


def test_bad_hook_returns_do_not_crash_the_process():
    # Before the fix some of these reached TensorFlow's C++ with an invalid dtype or a
    # truncated rank: run them where a crash cannot take the test session down.
    script = textwrap.dedent("""
        import tensorflow as tf, tf_ophandlers as oh
        class Box:
            def __init__(self, t): self.t = t
        class FakeDType:
            as_datatype_enum = 9999
        class H(oh.OpHandler):
            def __init__(self, **r): self.r = r
            def value_dtype(self, v): return self.r.get("value_dtype", v.t.dtype)
            def num_dims(self, v): return self.r.get("num_dims", v.t.shape.rank)
            def dim(self, v, i): return self.r.get("dim", v.t.shape[i])
            def execute(self, op, inputs):
                vals = [i.t if isinstance(i, Box) else i for i in inputs]
                return [Box(o) for o in self.next.execute(op, vals)]
            def copy_off(self, v, device): return v.t
        results = []
        for kw in [dict(value_dtype=FakeDType()), dict(num_dims=2**40),
                   dict(num_dims=2**31 + 1), dict(dim=2**70), dict(dim="x")]:
            try:
                with H(**kw):
                    t = tf.constant([[1.0, 2.0]]) * 2.0
                t.shape, repr(t), t.numpy()
                results.append("no error")
            except oh.HandlerOutputError:
                results.append("HandlerOutputError")
            except BaseException as e:
                results.append(type(e).__name__)
        print(" ".join(results))
    """)
    stdout = run_python(script, timeout=240)
    assert stdout.split() == ["HandlerOutputError"] * 5, stdout


# ---- the same bad returns from a handler nested on another handler ---------------------
# Its outputs are inspected by core/stack.py before the C++ boundary sees them.

def test_numpy_return_under_an_outer_handler():
    def run():
        with oh.OpLogHandler():
            with Returns(lambda outs: [o.numpy() for o in outs]):
                tf.sin(tf.constant([0.5]))

    _raises_output_error(run, "Returns()", "execute", "op Sin", "numpy.ndarray")


@pytest.mark.parametrize("make", [lambda outs: outs[0], lambda outs: 3],
                         ids=["bare_tensor", "int"])
def test_non_list_return_under_an_outer_handler(make):
    with pytest.raises(oh.HandlerOutputError, match="Returns.*execute.*op Sin"):
        with oh.OpLogHandler():
            with Returns(make):
                tf.sin(tf.constant(0.5))
