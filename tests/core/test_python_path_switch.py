"""OH_FAST_PATH=0 sends every op of a Python handler through the Python path
(`HandlerStack.execute`), the reference the C paths are compared with; CI runs the
differential tests that way too (.ci/run)."""
from python_process import run_python

_PROGRAM = r"""
import tensorflow as tf, tf_ophandlers as oh
from tf_ophandlers.core.stack import HandlerStack
calls = []
original = HandlerStack.execute
def counted(self, op, inputs):
    calls.append(op.type)
    return original(self, op, inputs)
HandlerStack.execute = counted
x = tf.constant([1., 2.])
with oh.OpHandler():          # a pass-through: its ops are forwarded in C by default
    y = tf.exp(x) * 2.
with oh.GradientTape() as tape:  # a tape: recorded in C by default
    tape.watch(x)
    z = tf.sin(x) * x
print(len(calls), float(tf.reduce_sum(y)), tape.gradient(z, x).numpy().tolist())
"""


def _run(fast_path):
    count, total, grad = run_python(_PROGRAM, env={"OH_FAST_PATH": fast_path}).split(" ", 2)
    return int(count), total, grad


def test_python_path_switch_gives_the_same_results_through_python():
    fast, python = _run("1"), _run("0")
    assert python[1:] == fast[1:]  # same values and gradients
    assert python[0] >= 4 > fast[0]  # Exp, Mul, Sin, Mul at least, all through Python
