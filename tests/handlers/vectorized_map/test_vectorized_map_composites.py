"""Composite tensors as oh.vectorized_map's elements and outputs: taken
apart through their `BatchableTypeSpec` as pfor does, against tf.vectorized_map where it
maps them and tf.map_fn where it fails."""
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from conftest import assert_same_tensors


class Masked(tf.experimental.BatchableExtensionType):
    values: tf.Tensor
    mask: tf.Tensor


class Unbatchable(tf.experimental.ExtensionType):
    values: tf.Tensor


def _masked():
    return Masked(tf.constant([[1., 2.], [3., 4.], [5., -6.]]),
                  tf.constant([[True, False], [True, True], [False, True]]))


def masked_sum(m):
    return tf.reduce_sum(tf.where(m.mask, m.values, 0.))


def masked_flip(m):
    return Masked(m.values * 2., tf.logical_not(m.mask))


def to_masked(x):
    return Masked(tf.nn.relu(x), x > 1.)


def mixed(e):
    m, scale = e
    return {"sum": masked_sum(m) * scale, "flip": masked_flip(m)}


def _components(out):
    return tf.nest.flatten(out, expand_composites=True)


@pytest.mark.parametrize("fn,elems", [
    (masked_sum, _masked),
    (masked_flip, _masked),
    (to_masked, lambda: tf.constant([[1., 2.], [3., -1.], [0.5, 4.]])),
    (mixed, lambda: (_masked(), tf.constant([1., 2., 3.]))),
], ids=["ext_in", "ext_in_out", "ext_out", "nested"])
def test_batchable_extension_types_match_tf_vectorized_map(fn, elems):
    want = tf.vectorized_map(fn, elems())
    got = oh.vectorized_map(fn, elems())
    assert type(got) is type(want)
    assert_same_tensors(_components(want), _components(got))
    assert_same_tensors(_components(want),
                        _components(tf.function(lambda e: oh.vectorized_map(fn, e))(elems())))


def test_gradient_through_an_extension_type_element():
    m = _masked()

    def run(vmap, tape_type):
        with tape_type() as tape:
            tape.watch(m.values)
            loss = tf.reduce_sum(vmap(masked_sum, Masked(m.values * 1., m.mask)) ** 2)
        return tape.gradient(loss, m.values)

    assert_same_tensors(run(tf.vectorized_map, tf.GradientTape),
                        run(oh.vectorized_map, oh.GradientTape))


def test_sparse_elements_map_row_by_row_as_tf_map_fn():
    # tf.vectorized_map 2.21 fails here (TypeError converting the SparseTensor); the map
    # takes it apart like any BatchableTypeSpec and runs the sparse ops once per example.
    sp = tf.sparse.from_dense(tf.constant([[1., 0.], [0., 2.], [3., 0.]]))
    want = tf.map_fn(tf.sparse.reduce_sum, sp, fn_output_signature=tf.float32)
    assert_same_tensors(want, oh.vectorized_map(tf.sparse.reduce_sum, sp))
    # Rows with different numbers of values have per-example shapes: a clear error.
    uneven = tf.sparse.from_dense(tf.constant([[1., 0.], [0., 2.], [3., 4.]]))
    with pytest.raises(ValueError, match="op DeserializeSparse gives outputs of different"):
        oh.vectorized_map(tf.sparse.reduce_sum, uneven)


def test_ragged_output_with_equal_rows_matches_tf_map_fn():
    x = tf.constant([[1., 2.], [3., 4.], [5., 6.]])
    fn = lambda r: tf.RaggedTensor.from_tensor(tf.reshape(r * 2., [1, 2]))  # noqa: E731
    want = tf.map_fn(fn, x, fn_output_signature=tf.RaggedTensorSpec([1, None], tf.float32, 1))
    got = oh.vectorized_map(fn, x)
    assert isinstance(got, tf.RaggedTensor)
    assert want.to_list() == got.to_list()


def test_ragged_rows_of_different_lengths_raise_a_clear_error():
    # tf.vectorized_map fails too (an InvalidArgumentError from a TensorList stack).
    rt = tf.ragged.constant([[1., 2.], [3.], [4., 5., 6.]])
    with pytest.raises(ValueError, match="oh.vectorized_map: op RaggedTensorFromVariant gives "
                       "outputs of different shapes"):
        oh.vectorized_map(tf.reduce_sum, rt)


def test_a_composite_without_batchable_spec_raises_tensorflows_error():
    u = Unbatchable(tf.ones([3, 2]))
    with pytest.raises(ValueError, match="must provide a `BatchableTypeSpec`"):
        oh.vectorized_map(lambda e: e.values, u)
    with pytest.raises(ValueError, match="must provide a `BatchableTypeSpec`"):
        oh.vectorized_map(lambda x: Unbatchable(x), tf.ones([3, 2]))


@pytest.mark.parametrize("composite", ["sparse", "ragged"])
def test_gradient_of_a_per_example_cond_next_to_a_composite_element(composite):
    """A per-example tf.cond in a map with a composite element: the replayed select of the
    cond's variant outputs had a SelectV2 gradient that cannot make variant zeros
    (TypeError "`dtype` <dtype: 'variant'> is not compatible with 0 of dtype int64")."""
    x = tf.constant([[1., -2.], [-3., 0.5], [2., 2.]])
    other = (tf.sparse.from_dense(tf.constant([[1., 0.], [0., 2.], [3., 0.]]))
             if composite == "sparse" else tf.ragged.constant([[1., 2.], [3., 4.], [5., 6.]]))

    def fn(v):
        return tf.cond(tf.reduce_sum(v) > 0., lambda: tf.tanh(v) * v, lambda: tf.sin(v))

    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(tf.vectorized_map(fn, x) ** 2)
    want = tape.gradient(loss, x)
    with oh.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(oh.vectorized_map(lambda e: fn(e[0]), (x, other)) ** 2)
    assert_same_tensors(want, tape.gradient(loss, x))
