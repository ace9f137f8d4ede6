"""oh.ParallelHandler: `pack`/`unpack` of nested structures (dicts, tuples, namedtuples),
and a tf.function creating its variables on its first call in the scope, from values
it computes (TensorFlow's tf.function lifts such initial values out; each component's
result is compared with the same function run by TensorFlow on that component's input)."""
import collections

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh

DEVICES = ["CPU:0", "CPU:1"]
Pair = collections.namedtuple("Pair", "a b")


@pytest.fixture
def parallel():
    return oh.ParallelHandler(DEVICES)


def _batch(i):
    return {"x": tf.fill([i + 1, 2], float(i + 1)), "y": (tf.constant(i), Pair([1., 2.], None))}


def _step(batch):
    return {"sum": tf.reduce_sum(batch["x"]) * tf.cast(batch["y"][0] + 1, tf.float32),
            "pair": Pair(tf.convert_to_tensor(batch["y"][1].a) * 2., None)}


def test_pack_and_unpack_nested_structures(parallel):
    with parallel:
        packed = parallel.pack([_batch(0), _batch(1)])
        assert parallel in oh.handler_of(packed["x"]).handlers and packed["y"][1].b is None
        assert isinstance(packed["y"][1], Pair)
        out = _step(packed)
    got = parallel.unpack(out)
    for i, part in enumerate(got):
        want = _step(_batch(i))
        tf.nest.assert_same_structure(part, want)
        for g, w in zip(tf.nest.flatten(part), tf.nest.flatten(want)):
            if w is None:
                assert g is None
                continue
            np.testing.assert_array_equal(g.numpy(), w.numpy())
            assert g.device.endswith("CPU:%d" % i)


def test_pack_of_number_lists_stays_one_tensor_per_component(parallel):
    with parallel:
        x = parallel.pack([[1., 2.], [3., 4.]])
    assert [t.numpy().tolist() for t in parallel.unpack(x)] == [[1., 2.], [3., 4.]]


def test_pack_of_different_structures_is_a_clear_error(parallel):
    with pytest.raises(ValueError, match=r"component 1 has another structure than component 0 "
                                         r"\(dict with keys \['b'\] vs dict with keys \['a'\]\)"):
        parallel.pack([{"a": tf.ones([1])}, {"b": tf.ones([1])}])
    with pytest.raises(ValueError, match="got 3 tensors for 2 components"):
        parallel.pack([{"a": 1.}] * 3)


def _make_function():
    holder = []

    @tf.function
    def f(x):
        if not holder:  # first call: variables from values computed in the function
            holder.append(tf.Variable(tf.zeros_like(x) + tf.reduce_mean(x)))
            holder.append(tf.Variable(tf.random.stateless_normal([3, 2], seed=[1, 2])))
        holder[0].assign_add(x)
        return tf.matmul(holder[0][None, :], holder[1])

    return f, holder


def test_tf_function_creates_its_variables_on_first_call_in_the_scope(parallel, tmp_path):
    inputs = [tf.constant([1., 2., 3.]), tf.constant([-1., 0., 4.])]
    want = []
    for x in inputs:  # TensorFlow on each component's input
        f, _ = _make_function()
        want.append([f(x).numpy(), f(x).numpy()])
    f, holder = _make_function()
    with parallel:
        x = parallel.pack(inputs)
        first, second = f(x), f(x)
    for i in range(2):
        np.testing.assert_allclose(parallel.unpack(first)[i].numpy(), want[i][0], rtol=1e-6)
        np.testing.assert_allclose(parallel.unpack(second)[i].numpy(), want[i][1], rtol=1e-6)
    assert all(v._oh_parallel is parallel for v in holder)  # pylint: disable=protected-access
    # Saved and restored per component, as the handler's other variables.
    path = tf.train.Checkpoint(v=holder[0]).save(str(tmp_path / "ckpt"))
    saved = [t.numpy() for t in parallel.unpack(tf.convert_to_tensor(holder[0]))]
    with parallel:
        holder[0].assign(tf.zeros([3]))
    tf.train.Checkpoint(v=holder[0]).restore(path)
    for got, w in zip(parallel.unpack(tf.convert_to_tensor(holder[0])), saved):
        np.testing.assert_array_equal(got.numpy(), w)
