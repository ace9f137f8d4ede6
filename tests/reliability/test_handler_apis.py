"""Every shipped handler's public API on inputs that used to hang or crash,
against plain TensorFlow.

Each case runs in a subprocess with a timeout: a hang or a crash (segfault) fails that
case only, instead of the test session.
"""
import json

import numpy as np
import pytest
import tensorflow as tf
from python_process import run_python


_PRELUDE = r'''
import json, sys
import numpy as np
import tensorflow as tf
cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
import tf_ophandlers as oh

def desc(t):
    """dtype, shape and values of a tensor (None stays None), for the parent to compare."""
    if t is None:
        return None
    if isinstance(t, tf.IndexedSlices):
        return {"indexed_slices": True, "dense": desc(tf.convert_to_tensor(t))}
    t = tf.convert_to_tensor(t)
    return {"dtype": t.dtype.name, "shape": t.shape.as_list(), "values": t.numpy().tolist()}

def out(**results):
    print("RESULT " + json.dumps(results))
'''


def _run(body, timeout=120):
    stdout = run_python(_PRELUDE + body, timeout=timeout)
    lines = [l for l in stdout.splitlines() if l.startswith("RESULT ")]
    assert len(lines) == 1, stdout[-3000:]
    return json.loads(lines[0][len("RESULT "):])


def _desc(t):
    if t is None:
        return None
    if isinstance(t, tf.IndexedSlices):
        return {"indexed_slices": True, "dense": _desc(tf.convert_to_tensor(t))}
    t = tf.convert_to_tensor(t)
    return {"dtype": t.dtype.name, "shape": t.shape.as_list(), "values": t.numpy().tolist()}


def _same(got, want):
    """Same structure, kinds (dense vs IndexedSlices), dtypes, shapes and values."""
    assert (got is None) == (want is None), (got, want)
    if want is None:
        return
    assert set(got) == set(want), (got, want)
    if "indexed_slices" in want:
        return _same(got["dense"], want["dense"])
    assert got["dtype"] == want["dtype"] and got["shape"] == want["shape"], (got, want)
    np.testing.assert_allclose(np.asarray(got["values"], float),
                               np.asarray(want["values"], float), rtol=1e-6)


# -- devices: every API taking a device name ------------------------------------------------

_DEVICES = r'''
def attempt(make):
    try:
        make()
        return "accepted"
    except ValueError as e:
        return "ValueError: " + str(e)

results = {}
for name, comps in [("repeated", ["/cpu:0", "/cpu:0"]), ("respelled", ["CPU:1", "/device:CPU:1"]),
                    ("unknown", ["/cpu:0", "/cpu:7"]), ("unknown_job", ["/job:worker/cpu:0"]),
                    ("valid", ["/cpu:0", "CPU:1"])]:
    results["parallel_" + name] = attempt(lambda: oh.ParallelHandler(comps))

# A valid handler still reduces (no hang).
p = oh.ParallelHandler(["CPU:0", "CPU:1"])
with p:
    r = p.all_reduce(p.pack([tf.constant(1.), tf.constant(2.)]))
results["all_reduce"] = [float(t) for t in p.unpack(r)]

# tf.device and copy_off with a device that does not exist: soft placement, as plain TF.
x = tf.constant([1., 2.])
def placed(scope):
    with scope:
        with tf.device("/cpu:7"):
            y = tf.identity(x * 1.)
    return y.numpy().tolist(), y.device
with tf.device("/cpu:7"):
    plain = tf.identity(x * 1.)
results["plain_device"] = [plain.numpy().tolist(), plain.device]
for name, make in [("OpLogHandler", oh.OpLogHandler), ("CheckNumericsHandler", oh.CheckNumericsHandler),
                   ("GradientTape", oh.GradientTape), ("Async", oh.Async)]:
    results["device_" + name] = placed(make())
with oh.OpLogHandler():
    copied = oh.copy_off(oh.copy_on(x), "/cpu:7")
results["copy_off"] = [copied.numpy().tolist(), copied.device]
out(**results)
'''


def test_device_names_are_checked_or_placed_as_plain_tensorflow():
    r = _run(_DEVICES)
    for name in ("repeated", "respelled"):
        assert r["parallel_" + name].startswith("ValueError: oh.ParallelHandler") \
            and "same device" in r["parallel_" + name], r["parallel_" + name]
    for name in ("unknown", "unknown_job"):
        assert r["parallel_" + name].startswith("ValueError: oh.ParallelHandler") \
            and "not a device of this program" in r["parallel_" + name], r["parallel_" + name]
    assert r["parallel_valid"] == "accepted"
    assert r["all_reduce"] == [3., 3.]
    for key in ("device_OpLogHandler", "device_CheckNumericsHandler", "device_GradientTape",
                "device_Async", "copy_off"):
        assert r[key] == r["plain_device"], (key, r[key], r["plain_device"])


# -- tf.py_function and tf.numpy_function under every shipped handler -----------------------

_X = [1., -2., 3.]


def _double_plus_one(a):
    return a * 2. + 1.


def _square(a):
    return (a ** 2).astype(np.float32)


def _plain_values():
    x = tf.constant(_X)
    y = tf.py_function(_double_plus_one, [x], tf.float32)
    z = tf.numpy_function(_square, [x], tf.float32)
    return {"py": _desc(y), "np": _desc(z), "sum": _desc(y + z)}


_FUNCS = r'''
def double_plus_one(a):
    return a * 2. + 1.

def square(a):
    return (a ** 2).astype(np.float32)

x = tf.constant(%r)

def program(x):
    y = tf.py_function(double_plus_one, [x], tf.float32)
    z = tf.numpy_function(square, [x], tf.float32)
    return y, z, y + z
''' % (_X,)

_UNDER = {
    "OpHandler": "oh.OpHandler()",
    "OpLogHandler": "oh.OpLogHandler()",
    "CheckNumericsHandler": "oh.CheckNumericsHandler()",
    "Lazy": "oh.Lazy()",
    "Async": "oh.Async()",
    "TraceAndExecute": "oh.TraceAndExecute()",
}

# Every case below, in one subprocess (a process start costs seconds on a loaded machine):
# each case's result or error is reported under its name.
_CASES = {name: r"""
with %s:
    y, z, s = program(x)
result = dict(py=desc(y), np=desc(z), sum=desc(s))
""" % make for name, make in _UNDER.items() if name != "OpHandler"}
_CASES["GradientTape"] = r"""
with oh.GradientTape(persistent=True) as tape:
    tape.watch(x)
    y = tf.py_function(lambda a: a * a * 3., [x], tf.float32)
    z = tf.numpy_function(square, [x], tf.float32)
result = dict(py=desc(y), dpy=desc(tape.gradient(y, x)), dnp=desc(tape.gradient(z, x)))
"""
_CASES["ForwardAccumulator"] = r"""
tangent = tf.constant([1., 0.5, -1.])
with oh.ForwardAccumulator(x, tangent) as acc:
    y = tf.py_function(lambda a: a * a * 3., [x], tf.float32)
result = dict(py=desc(y), jvp=desc(acc.jvp(y)))
"""
_CASES["ShapeInference"] = r"""
calls = []
def counted(f):
    def g(a):
        calls.append(1)
        return f(a)
    return g
def traced_program(x):
    y = tf.py_function(counted(double_plus_one), [x], tf.float32)
    return y, tf.ensure_shape(y, [3]) * 2.
specs = oh.eval_shape(traced_program, tf.TensorSpec([3], tf.float32))
# Eagerly, tf.numpy_function calls its Python function at once on numpy values: under
# eval_shape there are none.
try:
    oh.eval_shape(lambda x: tf.numpy_function(counted(square), [x], tf.float32),
                  tf.TensorSpec([3], tf.float32))
    numpy_error = None
except oh.CopyOffError as e:
    numpy_error = str(e)
result = dict(specs=[[s.dtype.name, s.shape.as_list() if s.shape.rank is not None else None]
                     for s in specs], calls=len(calls), numpy_error=numpy_error)
"""
_CASES["ParallelHandler"] = r"""
p = oh.ParallelHandler(["CPU:0", "CPU:1"])
with p:
    xs = p.pack([x, x + 1.])
    y = tf.py_function(double_plus_one, [xs], tf.float32)
    # Eagerly, tf.numpy_function calls its Python function at once on one numpy value.
    try:
        tf.numpy_function(square, [xs], tf.float32)
        numpy_error = None
    except oh.CopyOffError as e:
        numpy_error = str(e)
ys = p.unpack(y)
result = dict(py0=desc(ys[0]), py1=desc(ys[1]), numpy_error=numpy_error,
              devices=[t.device for t in ys])
"""


def _all_cases_script():
    parts = [_FUNCS, "results = {}\n"]
    for name, body in _CASES.items():
        indented = "".join("    " + line + "\n" for line in body.strip("\n").splitlines())
        parts.append("try:\n%s    results[%r] = result\nexcept Exception as e:\n"
                     "    results[%r] = {'error': type(e).__name__, 'message': str(e)[:800]}\n"
                     % (indented, name, name))
    parts.append("out(**results)\n")
    return "".join(parts)


@pytest.fixture(scope="module")
def under_handlers():
    return _run(_all_cases_script(), timeout=300)


def _case(results, name):
    got = results[name]
    assert "error" not in got, got
    return got


def test_py_function_under_a_plain_op_handler():
    got = _run(_FUNCS + r"""
with oh.OpHandler():
    y, z, s = program(x)
out(py=desc(y), np=desc(z), sum=desc(s))
""")
    want = _plain_values()
    for key in want:
        _same(got[key], want[key])


@pytest.mark.parametrize("name", ["OpLogHandler", "CheckNumericsHandler", "Lazy", "Async",
                                  "TraceAndExecute"])
def test_py_and_numpy_function_under_a_handler_match_plain_tensorflow(name, under_handlers):
    got = _case(under_handlers, name)
    want = _plain_values()
    for key in want:
        _same(got[key], want[key])


def test_py_function_under_gradient_tape_matches_tf_gradient_tape(under_handlers):
    # TensorFlow differentiates py_function (its EagerPyFunc gradient replays the tape the
    # kernel kept); numpy_function has no gradient (None). Before: KeyError b'pyfunc_0'.
    x = tf.constant(_X)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = tf.py_function(lambda a: a * a * 3., [x], tf.float32)
        z = tf.numpy_function(_square, [x], tf.float32)
    want = {"py": _desc(y), "dpy": _desc(tape.gradient(y, x)),
            "dnp": _desc(tape.gradient(z, x))}
    got = _case(under_handlers, "GradientTape")
    for key in want:
        _same(got[key], want[key])


def test_py_function_under_forward_accumulator_matches_tensorflows(under_handlers):
    x, tangent = tf.constant(_X), tf.constant([1., 0.5, -1.])
    try:
        with tf.autodiff.ForwardAccumulator(x, tangent) as acc:
            y = tf.py_function(lambda a: a * a * 3., [x], tf.float32)
        want = {"py": _desc(y), "jvp": _desc(acc.jvp(y))}
    except Exception as e:  # pylint: disable=broad-except
        want = {"error": type(e).__name__}
    got = under_handlers["ForwardAccumulator"]
    if "error" in want:
        assert got.get("error") == want["error"], got
    else:
        assert "error" not in got, got
        for key in want:
            _same(got[key], want[key])


def test_py_function_under_shape_inference_matches_tracing(under_handlers):
    # A py_function's output shape is unknown to its shape function: eval_shape gives what
    # tracing gives, and the Python function never runs.
    def program(x):
        y = tf.py_function(_double_plus_one, [x], tf.float32)
        return y, tf.ensure_shape(y, [3]) * 2.

    traced = tf.function(program).get_concrete_function(
        tf.TensorSpec([3], tf.float32)).structured_outputs
    want = [[t.dtype.name, t.shape.as_list() if t.shape.rank is not None else None]
            for t in traced]
    got = _case(under_handlers, "ShapeInference")
    assert got["specs"] == want and got["calls"] == 0
    # tf.numpy_function runs its Python function eagerly on numpy values: a clear error.
    assert got["numpy_error"].startswith("oh.ShapeInference: a tensor of spec")


def test_py_function_under_parallel_handler_runs_per_component(under_handlers):
    want = {"py%d" % i: _desc(tf.py_function(_double_plus_one, [tf.constant(_X) + i],
                                             tf.float32)) for i in range(2)}
    got = _case(under_handlers, "ParallelHandler")
    for key in want:
        _same(got[key], want[key])
    # tf.numpy_function runs its Python function eagerly on one numpy value: a clear error
    # pointing to unpack.
    assert got["numpy_error"].startswith("oh.ParallelHandler: a tensor with 2 components")
    assert "unpack" in got["numpy_error"]
    assert [d.rsplit(":", 1)[-1] for d in got["devices"]] == ["0", "1"]
