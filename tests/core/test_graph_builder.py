"""core/graph_builder.py: the key of a recorded op program changes with every ingredient
the built function depends on, and replaying the program equals running it eagerly."""
import numpy as np
import tensorflow as tf

from tf_ophandlers.core import graph_builder
from tf_ophandlers.core.op import Op

F32 = tf.float32


def _program(mul="Mul", alpha=0.2, wiring=((-1, 0), (-1, 1)), device=None):
    return [(Op.create(mul, T=F32), list(wiring), device),
            (Op.create("LeakyRelu", T=F32, alpha=alpha), [(0, 0)], None),
            (Op.create("AddV2", T=F32), [(1, 0), (-1, 0)], None)]


def _key(program=None, returned=((2, 0),), inputs=None, **flags):
    if inputs is None:
        inputs = [tf.ones([2, 3]), tf.ones([2, 3])]
    return graph_builder.program_key(_program() if program is None else program,
                                     list(returned), inputs, **flags)


def test_every_ingredient_changes_the_key():
    base = _key()
    assert _key() == base and hash(_key()) == hash(base)  # deterministic, hashable
    variants = {
        "op type": _key(_program(mul="Sub")),
        "attribute": _key(_program(alpha=0.3)),
        "wiring": _key(_program(wiring=((-1, 1), (-1, 0)))),
        "wiring to the same input": _key(_program(wiring=((-1, 0), (-1, 0)))),
        "device": _key(_program(device="/cpu:1")),
        "returned outputs": _key(returned=((1, 0),)),
        "more returned outputs": _key(returned=((1, 0), (2, 0))),
        "input dtype": _key(inputs=[tf.ones([2, 3], tf.float64), tf.ones([2, 3])]),
        "input shape": _key(inputs=[tf.ones([2, 4]), tf.ones([2, 3])]),
        "unknown dims (a spec)": _key(inputs=[tf.TensorSpec([None, 3]), tf.ones([2, 3])]),
        "unknown rank (a spec)": _key(inputs=[tf.TensorSpec(None), tf.ones([2, 3])]),
        "a flag": _key(jit_compile=True),
        "a flag's value": _key(jit_compile=False),
    }
    for name, key in variants.items():
        assert key != base, name
    assert len(set(variants.values())) == len(variants)
    # Values are not part of it (constants are inputs), eager and spec agree.
    assert _key(inputs=[tf.zeros([2, 3]), tf.fill([2, 3], 7.0)]) == base
    assert _key(inputs=[tf.TensorSpec([2, 3]), tf.TensorSpec([2, 3])]) == base


def test_replay_equals_eager_and_places_ops():
    rng = np.random.default_rng(0)
    a, b = (tf.constant(rng.normal(size=(2, 3)).astype("float32")) for _ in range(2))
    program = _program(device="/cpu:0")

    @tf.function(autograph=False)
    def fn(x, y):
        graph = tf.compat.v1.get_default_graph()
        results = graph_builder.replay(graph, program, [x, y])
        assert "CPU:0" in results[0][0].op.device and not results[1][0].op.device
        return results[2][0]

    ref = tf.nn.leaky_relu(a * b, alpha=0.2) + a
    np.testing.assert_allclose(fn(a, b).numpy(), ref.numpy(), rtol=1e-6)


def test_replay_fills_only_the_given_indices():
    program = _program()

    @tf.function(autograph=False)
    def fn(x, y):
        graph = tf.compat.v1.get_default_graph()
        results = [None, [tf.zeros_like(x) - 1.0], None]  # node 1 computed elsewhere
        graph_builder.replay(graph, program, [x, y], results, [0, 2])
        return results[2][0]

    x = tf.ones([2, 3])
    np.testing.assert_allclose(fn(x, x).numpy(), np.zeros((2, 3)))
