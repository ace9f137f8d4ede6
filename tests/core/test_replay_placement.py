"""Ops a handler hook creates on a physical device (`scope.on_device`, the hooks'
`tf.device`) while a function is replayed become nodes placed on that device, as the ops
run eagerly. (They were unplaced, so TensorFlow ran them on its default device; oh.Mesh
had to work around it.)"""
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers.core import scope
from tf_ophandlers.core.functions import call as function_calls

CPU1 = "/job:localhost/replica:0/task:0/device:CPU:1"


class MulOnCpu1(oh.OpHandler):
    """Runs every Mul on CPU:1 with TensorFlow calls (a hook's own ops)."""

    def execute(self, op, inputs):
        if op.type == "Mul":
            with scope.on_device(CPU1):
                return [tf.add(inputs[0], 0.0) * inputs[1]]
        return oh.next_stack().execute(op, inputs)


def test_hook_ops_on_a_device_are_placed_eagerly_and_in_replayed_functions():
    a, b = tf.constant([2.0, 4.0]), tf.constant([3.0, 5.0])
    with MulOnCpu1():
        eager = a * b
    assert eager.device.endswith("CPU:1") or oh.copy_off(eager).device.endswith("CPU:1")

    @tf.function
    def f(x, y):
        return x * y + 1.0

    before = set(function_calls._cache)  # pylint: disable=protected-access
    with MulOnCpu1():
        got = f(a, b)
    tf.debugging.assert_equal(oh.copy_off(got), a * b + 1.0)
    new = [k for k in function_calls._cache if k not in before]  # pylint: disable=protected-access
    assert len(new) == 1
    nodes = function_calls._cache[new[0]].compiled.function.function_def.node_def  # pylint: disable=protected-access
    made = [n for n in nodes if n.op in ("AddV2", "Mul")]
    hook_nodes = [n for n in made if n.op == "Mul" or n.device]
    assert hook_nodes, [(n.op, n.device) for n in nodes]
    for n in made:
        if n.op == "Mul":
            assert n.device.endswith("CPU:1"), (n.op, n.device)
    # The function's own `+ 1.0` is not the hook's: it stays where the call runs.
    adds = [n for n in made if n.op == "AddV2"]
    assert any(n.device.endswith("CPU:1") for n in adds)  # the hook's tf.add
    assert any(not n.device.endswith("CPU:1") for n in adds)  # the function's + 1.0
