"""Optimizers updating a vocabulary-sharded embedding on oh.Mesh (2x2 "batch" x "model"
mesh of four logical CPUs) against single-device training on the same inputs: Keras's
SGD/Adagrad/Adam (sparse ResourceScatter* updates, dense slots) and the
ResourceSparseApply* kernels of TensorFlow's v1 optimizers (each device applies the rows
it holds), eager and in a replayed tf.function step."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from conftest import assert_close
from tf_ophandlers.handlers.mesh import variables as mesh_variables

DEVICES = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
IDS = np.array([[1, 5, 5], [7, 0, 2], [5, 6, 1], [3, 3, 4]], dtype=np.int32)  # repeats


@pytest.fixture
def mesh():
    return oh.Mesh({"batch": 2, "model": 2}, DEVICES)


@pytest.fixture
def sparse_applies(monkeypatch):
    """The ResourceSparseApply* ops oh.Mesh applied, by type."""
    seen = []
    run = mesh_variables.sparse_apply

    def spy(mesh, op, inputs):
        seen.append(op.type)
        return run(mesh, op, inputs)

    monkeypatch.setattr(mesh_variables, "sparse_apply", spy)
    return seen


def _model():
    ids = keras.Input((3,), dtype="int32")
    h = keras.layers.Embedding(8, 4, name="emb")(ids)
    out = keras.layers.Dense(2, name="head")(keras.layers.Flatten()(h))
    return keras.Model(ids, out)


@pytest.mark.parametrize("optimizer", ["SGD", "Adagrad", "Adam"])
def test_keras_embedding_sharded_on_vocabulary_trains_like_one_device(mesh, optimizer):
    y = np.random.default_rng(0).normal(size=(4, 2)).astype("float32")
    with mesh:
        model = _model()
        emb = model.get_layer("emb").embeddings
        mesh.shard_variable(emb, ("model", None))
        opt = getattr(keras.optimizers, optimizer)(0.1)
    ref = _model()
    ref.set_weights(model.get_weights())
    ref_opt = getattr(keras.optimizers, optimizer)(0.1)
    for _ in range(3):
        with mesh:
            x = mesh.shard(IDS, ("batch", None))
            with oh.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
        with tf.GradientTape() as tape:
            ref_loss = tf.reduce_mean(tf.square(ref(IDS) - y))
        ref_grads = tape.gradient(ref_loss, ref.trainable_variables)
        ref_opt.apply_gradients(zip(ref_grads, ref.trainable_variables))
        assert_close(loss, ref_loss, 1e-5)
    for v, r in zip(model.trainable_variables, ref.trainable_variables):
        assert_close(v, r, 1e-5)
    assert mesh.layout_of(emb) == ("model", None)
    assert [s.shape.as_list() for s in mesh.unpack(tf.identity(emb))][0] == [4, 4]
    assert not mesh.fallbacks


V1_OPTIMIZERS = {  # name: (constructor, the sparse kernel it applies to the table)
    "Adagrad": (lambda: tf.compat.v1.train.AdagradOptimizer(0.1), "ResourceSparseApplyAdagrad"),
    "Momentum": (lambda: tf.compat.v1.train.MomentumOptimizer(0.1, 0.9, use_nesterov=True),
                 "ResourceSparseApplyMomentum"),
    "Ftrl": (lambda: tf.compat.v1.train.FtrlOptimizer(0.1, l1_regularization_strength=0.01),
             "ResourceSparseApplyFtrl"),
}
CASES = [("Adagrad", ("model", None)), ("Adagrad", (None, "model")),
         ("Adagrad", ("batch", "model")), ("Momentum", ("model", None)),
         ("Ftrl", ("batch", "model"))]


def _lookup_loss(table, w, ids):
    return tf.reduce_sum(tf.square(tf.matmul(tf.reshape(tf.gather(table, ids), [4, 12]), w)))


@pytest.mark.parametrize("name, layout", CASES)
def test_sparse_apply_kernels_on_a_mesh_variable_match_one_device(mesh, sparse_applies,
                                                                   name, layout):
    rng = np.random.default_rng(1)
    table0 = rng.normal(size=(8, 4)).astype("float32")
    w0 = rng.normal(size=(12, 2)).astype("float32") * 0.3
    make, kernel = V1_OPTIMIZERS[name]
    with mesh:
        table = tf.Variable(mesh.shard(table0, layout))
        w = tf.Variable(mesh.shard(w0, (None, "model")))
        opt = make()
    ref, ref_w, ref_opt = tf.Variable(table0), tf.Variable(w0), make()

    def step(opt, table, w, ids):
        with tf.GradientTape() as tape:
            loss = _lookup_loss(table, w, ids)
        grads = tape.gradient(loss, [table, w])
        assert isinstance(grads[0], tf.IndexedSlices)
        opt.apply_gradients(zip(grads, [table, w]))
        return loss

    replayed = tf.function(step)
    for i in range(3):
        if i == 2:
            assert not mesh.fallbacks  # eager: every op had a rule
        with mesh:
            x = mesh.shard(IDS, ("batch", None))
            # Eager steps first (the slot variables take the table's layout), then the
            # same step replayed as a tf.function.
            loss = step(opt, table, w, x) if i < 2 else replayed(opt, table, w, x)
        ref_loss = step(ref_opt, ref, ref_w, IDS)
        assert_close(loss, ref_loss, 1e-5)
        assert_close(table, ref, 1e-5)
        assert_close(w, ref_w, 1e-5)
    assert kernel in sparse_applies
    assert mesh.layout_of(table) == layout
    for slot in opt.get_slot_names():
        assert mesh.layout_of(opt.get_slot(table, slot)) == layout
    # Replayed too: the shape arithmetic of the gradient (ExpandDims/ConcatV2 of shapes)
    # is folded to constants, so its Reshape has a rule; the deduplicated indices' segment
    # sum has a row count computed in the graph.
    assert not mesh.fallbacks


def test_sparse_apply_errors_name_the_op(mesh):
    with mesh:
        table = tf.Variable(mesh.shard(np.ones((8, 4), np.float32), ("model", None)))
        accum = tf.Variable(mesh.shard(np.ones((8, 4), np.float32), (None, "model")))
        with pytest.raises(NotImplementedError,
                           match="ResourceSparseApplyAdagradV2 updates variables of different"):
            tf.raw_ops.ResourceSparseApplyAdagradV2(
                var=table.handle, accum=accum.handle, lr=0.1, epsilon=1e-7,
                grad=tf.ones([2, 4]), indices=tf.constant([1, 6]))
        accum2 = tf.Variable(mesh.shard(np.ones((8, 4), np.float32), ("model", None)))
        with pytest.raises(tf.errors.InvalidArgumentError, match="out of range"):
            tf.raw_ops.ResourceSparseApplyAdagradV2(
                var=table.handle, accum=accum2.handle, lr=0.1, epsilon=1e-7,
                grad=tf.ones([2, 4]), indices=tf.constant([1, 8]))
    outside = tf.Variable(np.ones((8, 4), np.float32))
    with mesh, pytest.raises(oh.PlacementError if hasattr(oh, "PlacementError") else Exception,
                             match="created outside"):
        tf.raw_ops.ResourceSparseApplyAdagradV2(
            var=outside.handle, accum=accum2.handle, lr=0.1, epsilon=1e-7,
            grad=tf.ones([2, 4]), indices=tf.constant([1, 6]))


@pytest.mark.parametrize("layout", [(None, "model"), ("batch", "model")])
def test_proximal_adagrad_dense_kernel_replayed_matches_one_device(mesh, layout):
    """ResourceApplyProximalAdagrad in a replayed step: its slot variable is only written
    by the kernel (never read), so the replay's resource placeholder takes its dtype from
    the kernel's `T` (TensorFlow's shape inference of the kernel needs the handle data)."""
    rng = np.random.default_rng(2)
    w0 = rng.normal(size=(6, 4)).astype("float32")
    x0 = rng.normal(size=(4, 6)).astype("float32")

    def make():
        return tf.compat.v1.train.ProximalAdagradOptimizer(
            0.1, l1_regularization_strength=0.01, l2_regularization_strength=0.01)

    with mesh:
        w = tf.Variable(mesh.shard(w0, layout))
        opt = make()
    ref, ref_opt = tf.Variable(w0), make()

    def step(opt, w, x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(tf.matmul(x, w)))
        opt.apply_gradients([(tape.gradient(loss, w), w)])
        return loss

    replayed = tf.function(step)
    for i in range(3):
        with mesh:
            x = mesh.shard(x0, ("batch", None))
            loss = step(opt, w, x) if i == 0 else replayed(opt, w, x)  # eager first: slots
        assert_close(loss, step(ref_opt, ref, x0), 1e-5)
        assert_close(w, ref, 1e-5)
        assert_close(opt.get_slot(w, "accumulator"), ref_opt.get_slot(ref, "accumulator"), 1e-5)
    assert mesh.layout_of(w) == layout
    assert mesh.layout_of(opt.get_slot(w, "accumulator")) == layout
    assert not mesh.fallbacks
