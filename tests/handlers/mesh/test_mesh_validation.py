"""oh.Mesh refuses bad input before it changes anything: an optimizer step whose
optimizer lives outside the mesh, a checkpoint that does not fit every variable, shards
of different shapes given to `mesh.pack`; and its checkpoints take Keras 3 variables.
Results are compared with the same program on one device."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from conftest import assert_close

DEVICES = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]


@pytest.fixture
def mesh():
    return oh.Mesh({"batch": 2, "model": 2}, DEVICES)


def _grads_step(w, opt, x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(tf.matmul(x, w)))
    opt.apply_gradients([(tape.gradient(loss, w), w)])


def test_optimizer_made_outside_the_mesh_fails_before_any_write_then_advice_works(mesh):
    rng = np.random.default_rng(0)
    w0, x = rng.normal(size=(4, 6)).astype("float32"), rng.normal(size=(2, 4)).astype("float32")
    outside = keras.optimizers.Adam(0.1)
    with mesh:
        w = tf.Variable(mesh.shard(w0, (None, "model")))
    for _ in range(2):  # a retry must not apply the step twice
        with pytest.raises(oh.PlacementError, match=(
                r"oh.Mesh: Adam.apply would write variable .*iteration.*created outside "
                r"Mesh\(batch=2, model=2\).*nothing was written.*make a new one")):
            with mesh:
                _grads_step(w, outside, x)
        assert_close(mesh.unshard(w), w0, 0)
        assert int(outside.iterations.numpy()) == 0
    # The advice: a new optimizer made in the mesh's scope.
    with mesh:
        opt = keras.optimizers.Adam(0.1)
    ref, ref_opt = tf.Variable(w0), keras.optimizers.Adam(0.1)
    for _ in range(2):
        with mesh:
            _grads_step(w, opt, x)
        _grads_step(ref, ref_opt, tf.constant(x))
    assert_close(mesh.unshard(w), ref, 1e-5)
    assert int(opt.iterations.numpy()) == int(ref_opt.iterations.numpy()) == 2


def test_restore_shards_checks_every_variable_before_writing_any(mesh, tmp_path):
    rng = np.random.default_rng(1)
    a0, b0 = rng.normal(size=(4, 6)).astype("float32"), rng.normal(size=(8, 2)).astype("float32")
    with mesh:
        a = tf.Variable(mesh.shard(a0, (None, "model")))
        b = tf.Variable(mesh.shard(b0, ("batch", None)))
        wrong = tf.Variable(mesh.shard(np.zeros((8, 4), "float32"), ("batch", None)))
    prefix = str(tmp_path / "ckpt")
    mesh.save_shards(prefix, {"a": a, "b": b})
    with mesh:
        a.assign(tf.zeros([4, 6]))
    with pytest.raises(ValueError, match=r"oh.Mesh.restore_shards: 'b' was saved as "
                                         r"float32 \[8, 2\]; the variable is float32 \[8, 4\]"):
        mesh.restore_shards(prefix, {"a": a, "b": wrong})
    assert_close(mesh.unshard(a), np.zeros((4, 6)), 0)  # 'a' was not overwritten
    with pytest.raises(KeyError, match="'c' is not in the checkpoint"):
        mesh.restore_shards(prefix, {"a": a, "c": b})
    assert_close(mesh.unshard(a), np.zeros((4, 6)), 0)
    mesh.restore_shards(prefix, {"a": a, "b": b})
    assert_close(mesh.unshard(a), a0, 0)


def test_save_and_restore_shards_of_keras_variables(mesh, tmp_path):
    keras.utils.set_random_seed(3)
    ref = keras.layers.Dense(4)
    ref.build((None, 6))
    with mesh:
        layer = keras.layers.Dense(4)
        layer.build((None, 6))
        layer.kernel.assign(ref.kernel.numpy())
        layer.bias.assign(np.arange(4, dtype="float32"))
        mesh.shard_variable(layer.kernel, (None, "model"))
    assert isinstance(layer.kernel, keras.Variable) and isinstance(layer.kernel.dtype, str)
    prefix = str(tmp_path / "ckpt")
    mesh.save_shards(prefix, {"kernel": layer.kernel, "bias": layer.bias})
    with mesh:
        layer.kernel.assign(tf.zeros([6, 4]))
        layer.bias.assign(tf.zeros([4]))
    mesh.restore_shards(prefix, {"kernel": layer.kernel, "bias": layer.bias})
    assert_close(mesh.unshard(layer.kernel), ref.kernel, 0)
    assert_close(mesh.unshard(layer.bias), np.arange(4), 0)
    x = np.ones((2, 6), "float32")
    with mesh:
        y = layer(x)
    assert_close(mesh.unshard(y), ref(x) + np.arange(4), 1e-6)


def test_pack_refuses_shards_of_different_shapes_or_dtypes(mesh):
    with pytest.raises(ValueError, match=r"oh.Mesh.pack: shard 3 .*CPU:3.* is float32 "
                                         r"\(2, 2\), shard 0 is float32 \(2, 3\)"):
        mesh.pack([tf.ones([2, 3])] * 3 + [tf.ones([2, 2])], ("batch", None))
    with pytest.raises(ValueError, match=r"oh.Mesh.pack: shard 1 .* is int32"):
        mesh.pack([tf.ones([2]), tf.ones([2], tf.int32)] * 2, (None,))
    # Equal shards pack to the global shape TensorFlow's concatenation gives.
    parts = [tf.fill([2, 3], float(i)) for i in range(4)]
    packed = mesh.pack(parts, ("batch", "model"))
    want = tf.concat([tf.concat(parts[:2], 1), tf.concat(parts[2:], 1)], 0)
    assert packed.shape == want.shape
    assert_close(mesh.unshard(packed), want, 0)
