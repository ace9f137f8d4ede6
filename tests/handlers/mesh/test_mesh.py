"""oh.Mesh on a 2x2 ("batch", "model") mesh of four logical CPUs (conftest.py), against
plain TensorFlow on the same inputs."""
import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from conftest import assert_close
from python_process import run_python

DEVICES = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
DIMS = (None, "batch", "model")


@pytest.fixture
def mesh():
    return oh.Mesh({"batch": 2, "model": 2}, DEVICES)


def _rng_tensor(rng, shape):
    return tf.constant(rng.normal(size=shape).astype("float32"))


def test_shard_unpack_unshard_relayout(mesh):
    x = tf.reshape(tf.range(24.), [4, 6])
    with mesh:
        s = mesh.shard(x, ("batch", "model"))
        assert s.shape == (4, 6) and s.dtype == tf.float32
        assert mesh.layout_of(s) == ("batch", "model")
        shards = mesh.unpack(s)
        assert [p.shape.as_list() for p in shards] == [[2, 3]] * 4
        assert [p.device.rsplit(":", 1)[-1] for p in shards] == ["0", "1", "2", "3"]
        # device (batch=1, model=0) holds rows 2-3, columns 0-2
        assert_close(shards[2], x[2:, :3])
        r = mesh.relayout(s, ("model", None))
        assert mesh.layout_of(r) == ("model", None)
        assert_close(mesh.unpack(r)[1], x[2:])
    assert_close(s, x)  # copy-off: the full tensor
    assert_close(mesh.unshard(r), x)
    assert mesh.layout_of(x) is None
    packed = mesh.pack(shards, ("batch", "model"))
    assert mesh.layout_of(packed) == ("batch", "model") and packed.shape == (4, 6)
    assert_close(packed, x)


def test_bad_layouts_and_meshes_raise_naming_the_mesh(mesh):
    x = tf.ones([4, 6])
    with pytest.raises(ValueError, match=r"oh.Mesh.shard.*'data' is not a dimension"):
        mesh.shard(x, ("data", None))
    with pytest.raises(ValueError, match=r"oh.Mesh.shard.*2 entries for a tensor of rank 1"):
        mesh.shard(tf.ones([4]), ("batch", None))
    with mesh:
        v = tf.Variable(tf.ones([3, 2]))
    with pytest.raises(ValueError, match=r"oh.Mesh.shard_variable.*axis 0 of size 3 cannot be"):
        mesh.shard_variable(v, ("batch", None))
    with pytest.raises(ValueError, match=r"uses a mesh dimension twice"):
        mesh.shard(tf.ones([4, 4]), ("batch", "batch"))
    with pytest.raises(ValueError, match=r"oh.Mesh: a 2x2 mesh needs 4 devices, got 2"):
        oh.Mesh({"batch": 2, "model": 2}, DEVICES[:2])
    with pytest.raises(ValueError, match=r"oh.Mesh.*not a device"):
        oh.Mesh({"batch": 2}, ["CPU:0", "CPU:9"])


def _random_layout(rng, shape):
    layout, used = [], set()
    for n in shape:
        m = DIMS[rng.integers(3)]
        if m is None or m in used or n % 2:
            layout.append(None)
        else:
            layout.append(m)
            used.add(m)
    return tuple(layout)


def _fuzz_program(mesh, rng, watch):
    """A random program of elementwise, contraction, reduction and shape ops on sharded
    values; returns the (mesh, reference) pairs it computed (`watch` gets the first)."""
    def new(shape):
        t = _rng_tensor(rng, shape)
        return mesh.shard(t, _random_layout(rng, shape)), t

    shape = tuple(int(n) for n in rng.choice([2, 4], size=rng.integers(1, 4)))
    pool = [new(shape)]
    watch(*pool[0])
    for _ in range(6):
        a, ra = pool[rng.integers(len(pool))]
        s = tuple(a.shape.as_list())
        kind = rng.integers(10)
        if kind == 0:
            f = [tf.tanh, tf.nn.relu, tf.square, lambda t: tf.exp(0.1 * t)][rng.integers(4)]
            out = f(a), f(ra)
        elif kind == 1:  # broadcasting binary op with a new operand
            bs = tuple(1 if rng.random() < 0.3 else n for n in s[rng.integers(len(s) + 1):])
            b, rb = new(bs)
            f = [tf.add, tf.multiply, tf.subtract, tf.maximum][rng.integers(4)]
            out = (f(a, b), f(ra, rb)) if rng.random() < 0.5 else (f(b, a), f(rb, ra))
        elif kind == 2 and len(s) >= 2:  # (batch) matmul, transposes
            n = int(rng.choice([2, 4]))
            tb = bool(rng.integers(2))
            bshape = (n, s[-1]) if tb else (s[-1], n)
            if len(s) == 3 and rng.random() < 0.5:
                bshape = (s[0],) + bshape
            b, rb = new(bshape)
            out = tf.matmul(a, b, transpose_b=tb), tf.matmul(ra, rb, transpose_b=tb)
        elif kind == 3:  # einsum contracting the last axis
            n = int(rng.choice([2, 4]))
            b, rb = new((s[-1], n))
            letters = "abc"[:len(s) - 1]
            eq = "%sz,zy->%sy" % (letters, letters)
            out = tf.einsum(eq, a, b), tf.einsum(eq, ra, rb)
        elif kind == 4:  # reductions
            axes = [int(i) for i in np.flatnonzero(rng.random(len(s)) < 0.5)] or [0]
            keep = bool(rng.integers(2))
            f = [tf.reduce_sum, tf.reduce_mean, tf.reduce_max, tf.reduce_min][rng.integers(4)]
            out = f(a, axes, keepdims=keep), f(ra, axes, keepdims=keep)
        elif kind == 5:
            perm = [int(p) for p in rng.permutation(len(s))]
            out = tf.transpose(a, perm), tf.transpose(ra, perm)
        elif kind == 6 and len(s) >= 2:  # merge the last two axes, or split the first
            new_shape = s[:-2] + (s[-2] * s[-1],)
            if rng.random() < 0.5 and s[0] % 2 == 0:
                new_shape = (2, s[0] // 2) + s[1:]
            out = tf.reshape(a, new_shape), tf.reshape(ra, new_shape)
        elif kind == 7:
            out = tf.nn.softmax(a), tf.nn.softmax(ra)
        elif kind == 8:
            axis = int(rng.integers(len(s)))
            out = tf.concat([a, a * 2.], axis), tf.concat([ra, ra * 2.], axis)
        else:
            out = mesh.relayout(a, _random_layout(rng, s)), ra
        if len(out[1].shape) == 0:
            out = tf.reshape(out[0], [1]), tf.reshape(out[1], [1])
        pool.append(out)
    return pool


def test_fuzz_random_programs_with_random_layouts_match_tensorflow(mesh):
    """Values of every intermediate and the gradient of their total with respect to the
    first input (oh.GradientTape inside the mesh vs tf.GradientTape)."""
    rng = np.random.default_rng(1)
    checked = 0
    for _ in range(30):
        sources = []
        with tf.GradientTape() as ref_tape:
            with mesh:
                with oh.GradientTape() as tape:
                    def watch(got, ref):
                        tape.watch(got)
                        ref_tape.watch(ref)
                        sources.extend([got, ref])
                    pool = _fuzz_program(mesh, rng, watch)
                    total = tf.add_n([tf.reduce_sum(tf.sin(g)) for g, _ in pool])
                grad = tape.gradient(total, sources[0])
            ref_total = tf.add_n([tf.reduce_sum(tf.sin(r)) for _, r in pool])
        for got, ref in pool:
            assert got.shape == ref.shape and got.dtype == ref.dtype
            assert_close(got, ref, 1e-5)
            checked += 1
        assert_close(total, ref_total, 1e-4)
        assert_close(grad, ref_tape.gradient(ref_total, sources[1]), 1e-4)
    assert checked == 30 * 7
    assert not mesh.fallbacks, mesh.fallbacks  # every op of the corpus has a rule


def test_rules_keep_layouts_and_reduce_partial_sums(mesh):
    x, w = tf.ones([4, 6]), tf.ones([6, 8])
    with mesh:
        y = tf.matmul(mesh.shard(x, ("batch", "model")), mesh.shard(w, ("model", None)))
        assert mesh.layout_of(y) == ("batch", None)  # contracted over "model": reduced
        assert [p.shape.as_list() for p in mesh.unpack(y)] == [[2, 8]] * 4
        assert_close(mesh.unpack(y)[1], tf.fill([2, 8], 6.))
        s = tf.reduce_sum(mesh.shard(x, ("batch", "model")), axis=1)
        assert mesh.layout_of(s) == ("batch",)
        h = tf.reshape(mesh.shard(tf.ones([4, 6, 8]), ("batch", None, "model")), [4, 6, 2, 4])
        assert mesh.layout_of(h) == ("batch", None, "model", None)
        t = tf.transpose(h, [0, 2, 1, 3])
        assert mesh.layout_of(t) == ("batch", "model", None, None)
        p = tf.nn.softmax(mesh.shard(x, ("batch", "model")))
        assert mesh.layout_of(p) == ("batch", None)
    assert_close(y, tf.matmul(x, w))
    assert not mesh.fallbacks


def test_ops_without_rules_are_gathered_correct_and_reported_once(mesh, caplog):
    x = tf.reshape(tf.range(16.), [4, 4])
    with caplog.at_level(logging.WARNING, logger="tf_ophandlers"):
        with mesh:
            s = mesh.shard(x, ("batch", "model"))
            a = tf.math.cumsum(s, axis=0)
            b = tf.math.cumsum(s * 2., axis=1)
    assert_close(a, tf.math.cumsum(x, axis=0))
    assert_close(b, tf.math.cumsum(x * 2., axis=1))
    assert mesh.fallbacks["Cumsum"] == 2
    assert sum("Cumsum" in r.getMessage() for r in caplog.records) == 1


def test_gather_embeddings_sharded_on_vocabulary(mesh):
    rng = np.random.default_rng(0)
    table = _rng_tensor(rng, [8, 4])
    ids = tf.constant([[0, 7, 3], [5, 5, 1], [2, 6, 4], [1, 0, 7]])
    with mesh:
        emb = tf.Variable(mesh.shard(table, ("model", None)))
        sid = mesh.shard(ids, ("batch", None))
        out = tf.gather(emb, sid)
        out2 = tf.gather(mesh.shard(table, ("model", None)), sid)
        assert mesh.layout_of(out) == ("batch", None, None)
        with pytest.raises(tf.errors.InvalidArgumentError, match="oh.Mesh.*out of range"):
            tf.gather(emb, mesh.shard(tf.constant([8, 0]), (None,)))
    assert_close(out, tf.gather(table, ids))
    assert_close(out2, tf.gather(table, ids))
    assert not mesh.fallbacks


def test_variables_stay_sharded_and_checkpoint(mesh, tmp_path):
    rng = np.random.default_rng(0)
    w0 = _rng_tensor(rng, [4, 8])
    with mesh:
        v = tf.Variable(mesh.shard(w0, (None, "model")))
        assert mesh.layout_of(v) == (None, "model")
        assert [p.shape.as_list() for p in mesh.unpack(v.read_value())] == [[4, 4]] * 4
        v.assign(w0 * 2.)  # a full value takes the variable's layout
        assert mesh.layout_of(v.read_value()) == (None, "model")
        v.assign_add(mesh.shard(w0, ("batch", None)))
    assert_close(v, w0 * 3.)
    ckpt = tf.train.Checkpoint(v=v)
    path = ckpt.save(str(tmp_path / "ckpt"))
    with mesh:
        v.assign(tf.zeros([4, 8]))
    ckpt.restore(path)
    assert_close(v, w0 * 3.)
    assert mesh.layout_of(v) == (None, "model")
    assert [p.shape.as_list() for p in mesh.unpack(v.read_value())] == [[4, 4]] * 4


def test_host_variables_and_variable_ops_without_rules(mesh):
    host = tf.Variable([[1., 2.], [3., 4.], [5., 6.]])
    with mesh:
        rows = tf.gather(host, mesh.shard(tf.constant([2, 0]), ("batch",)))
        with pytest.raises(oh.PlacementError, match="oh.Mesh: op AssignAddVariableOp"):
            host.assign_add(tf.ones([3, 2]))
        v = tf.Variable(mesh.shard(tf.ones([4, 2]), ("batch", None)))
        with pytest.raises(NotImplementedError, match="oh.Mesh: op ResourceScatterNdAdd"):
            tf.raw_ops.ResourceScatterNdAdd(ref=v.handle, indices=tf.constant([[3]]),
                                            updates=tf.ones([1, 2]))
        v.scatter_add(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([3])))  # a rule
    assert_close(rows, [[5., 6.], [1., 2.]])
    assert_close(host, [[1., 2.], [3., 4.], [5., 6.]])
    assert_close(v, [[1., 1.], [1., 1.], [1., 1.], [2., 2.]])

def test_gradient_tape_gradients_match_and_have_variable_layouts(mesh):
    rng = np.random.default_rng(0)
    x0, w0, b0 = _rng_tensor(rng, [4, 6]), _rng_tensor(rng, [6, 8]), _rng_tensor(rng, [8])
    with mesh:
        w = tf.Variable(mesh.shard(w0, (None, "model")))
        b = tf.Variable(mesh.shard(b0, ("model",)))
        x = mesh.shard(x0, ("batch", None))
        with oh.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.softmax(tf.tanh(tf.matmul(x, w) + b)) ** 2)
        gw, gb = tape.gradient(loss, [w, b])
        assert mesh.layout_of(gw) == (None, "model") and mesh.layout_of(gb) == ("model",)
    rw, rb = tf.Variable(w0), tf.Variable(b0)
    with tf.GradientTape() as ref_tape:
        ref = tf.reduce_mean(tf.nn.softmax(tf.tanh(tf.matmul(x0, rw) + rb)) ** 2)
    assert_close(loss, ref, 1e-6)
    for g, r in zip([gw, gb], ref_tape.gradient(ref, [rw, rb])):
        assert_close(g, r, 1e-6)


@pytest.mark.parametrize("tape_type", [oh.GradientTape, tf.GradientTape])
def test_gradients_of_watched_sharded_tensors_keep_their_layouts(mesh, tape_type):
    """Backward computations that lose the layout (a sum's gradient broadcasts the seed;
    an op without a rule gathers): the gradient still gets its source's layout, as a
    sharded variable's does, with TensorFlow's values."""
    rng = np.random.default_rng(3)
    y0, z0, w0 = _rng_tensor(rng, [4, 6]), _rng_tensor(rng, [4, 6]), _rng_tensor(rng, [6, 8])
    c0 = _rng_tensor(rng, [4, 6])

    def grads(tape_type, y, z, w):
        with tape_type() as tape:
            tape.watch([y, z])
            loss = (tf.reduce_sum(y) + tf.reduce_mean(w * 2.)
                    + tf.reduce_sum(tf.cumsum(z, axis=1) * c0))
        return tape.gradient(loss, [y, z, w])

    rw = tf.Variable(w0)
    ref = grads(tf.GradientTape, y0, z0, rw)
    with mesh:
        y, z = mesh.shard(y0, ("batch", "model")), mesh.shard(z0, ("batch", None))
        w = tf.Variable(mesh.shard(w0, (None, "model")))
        got = grads(tape_type, y, z, w)
        assert [mesh.layout_of(g) for g in got] == [
            ("batch", "model"), ("batch", None), (None, "model")]
        assert [s.shape.as_list() for s in mesh.unpack(got[0])] == [[2, 3]] * 4
    for g, r in zip(got, ref):
        assert_close(g, r, 1e-6)


def test_gradients_of_sources_of_a_tape_in_a_replayed_function_keep_their_layouts(mesh):
    """As above with the tape inside a tf.function traced and called in the mesh's
    scope: the replay gives each gradient its source's layout (a sum's gradient is a
    broadcast). Called outside the scope, the same traced function gives TensorFlow's
    values."""
    rng = np.random.default_rng(4)
    y0, z0, w0 = _rng_tensor(rng, [4, 6]), _rng_tensor(rng, [4, 6]), _rng_tensor(rng, [6, 8])

    @tf.function
    def grads(y, z, w):
        with tf.GradientTape() as tape:
            tape.watch([y, z])
            loss = tf.reduce_sum(y) + tf.reduce_mean(w * 2.) + tf.reduce_sum(z * z)
        return tape.gradient(loss, [y, z, w])

    rw = tf.Variable(w0)
    ref = grads.python_function(y0, z0, rw)
    with mesh:
        y, z = mesh.shard(y0, ("batch", "model")), mesh.shard(z0, ("batch", None))
        w = tf.Variable(mesh.shard(w0, (None, "model")))
        for _ in range(2):
            got = grads(y, z, w)
            assert [mesh.layout_of(g) for g in got] == [
                ("batch", "model"), ("batch", None), (None, "model")]
            assert [s.shape.as_list() for s in mesh.unpack(got[0])] == [[2, 3]] * 4
            for g, r in zip(got, ref):
                assert_close(g, r, 1e-6)
    for g, r in zip(grads(y0, z0, rw), ref):  # (the same concrete function, unreplayed)
        assert_close(g, r, 1e-6)
    assert grads.experimental_get_tracing_count() == 1
    assert not mesh.fallbacks, mesh.fallbacks


def _train(mesh, model, ref, x, y, steps, lr=0.1):
    losses = []
    for _ in range(steps):
        with mesh:
            xs, ys = mesh.shard(x, ("batch",) + (None,) * (x.ndim - 1)), mesh.shard(
                y, ("batch",) + (None,) * (y.ndim - 1))
            with oh.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xs) - ys))
            grads = tape.gradient(loss, model.trainable_variables)
            for v, g in zip(model.trainable_variables, grads):
                assert mesh.layout_of(g) == mesh.layout_of(v), v.path
                v.assign_sub(lr * g)
        with tf.GradientTape() as tape:
            ref_loss = tf.reduce_mean(tf.square(ref(x) - y))
        for v, g in zip(ref.trainable_variables,
                        tape.gradient(ref_loss, ref.trainable_variables)):
            v.assign_sub(lr * g)
        losses.append((float(loss), float(ref_loss)))
    return np.array(losses)


def _shard_weights(mesh, pairs):
    for v, layout in pairs:
        mesh.shard_variable(v, layout)
        assert mesh.layout_of(v) == layout
        shards = mesh.unpack(v.value)  # each device holds half of a model-sharded weight
        assert shards[0].shape.num_elements() * 2 == v.shape.num_elements()


def test_keras_mlp_trains_like_a_single_device(mesh):
    def build():
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                 keras.layers.Dense(4)])
    with mesh:
        model = build()
    ref = build()
    ref.set_weights(model.get_weights())
    first, second = model.layers
    _shard_weights(mesh, [(first.kernel, (None, "model")), (first.bias, ("model",)),
                          (second.kernel, ("model", None))])
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 8)).astype("float32"), rng.normal(size=(8, 4)).astype("float32")
    losses = _train(mesh, model, ref, x, y, steps=5)
    np.testing.assert_allclose(losses[:, 0], losses[:, 1], rtol=1e-5, atol=1e-5)
    assert losses[-1, 0] < losses[0, 0]
    assert not mesh.fallbacks


class TransformerBlock(keras.Model):
    def __init__(self, dim=8, heads=4, hidden=16):
        super().__init__()
        self.att = keras.layers.MultiHeadAttention(num_heads=heads, key_dim=dim // heads)
        self.ln1, self.ln2 = keras.layers.LayerNormalization(), keras.layers.LayerNormalization()
        self.f1 = keras.layers.Dense(hidden, activation="gelu")
        self.f2 = keras.layers.Dense(dim)

    def call(self, x):
        x = self.ln1(x + self.att(x, x))
        return self.ln2(x + self.f2(self.f1(x)))


def megatron_layouts(block):
    """Megatron-LM's model parallelism: attention heads and the MLP's hidden units are
    split over "model"; the output projections contract over it (partial sums reduced)."""
    heads = {"query/kernel": (None, "model", None), "key/kernel": (None, "model", None),
             "value/kernel": (None, "model", None), "query/bias": ("model", None),
             "key/bias": ("model", None), "value/bias": ("model", None),
             "attention_output/kernel": ("model", None, None)}
    pairs = [(v, layout) for v in block.att.trainable_variables
             for suffix, layout in heads.items() if v.path.endswith(suffix)]
    return pairs + [(block.f1.kernel, (None, "model")), (block.f1.bias, ("model",)),
                    (block.f2.kernel, ("model", None))]


def test_transformer_block_trains_20_steps_like_a_single_device(mesh):
    shape = (4, 6, 8)
    with mesh:
        model = TransformerBlock()
        model(np.zeros(shape, "float32"))
    ref = TransformerBlock()
    ref(np.zeros(shape, "float32"))
    ref.set_weights(model.get_weights())
    pairs = megatron_layouts(model)
    assert len(pairs) == 10
    _shard_weights(mesh, pairs)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=shape).astype("float32"), rng.normal(size=shape).astype("float32")
    losses = _train(mesh, model, ref, x, y, steps=20)
    np.testing.assert_allclose(losses[:, 0], losses[:, 1], rtol=1e-5, atol=1e-5)
    assert losses[-1, 0] < losses[0, 0]
    assert not mesh.fallbacks


def test_replayed_tf_function_runs_the_spmd_program(mesh):
    rng = np.random.default_rng(0)
    x0, y0 = _rng_tensor(rng, [8, 8]), _rng_tensor(rng, [8, 8])
    w10, w20 = _rng_tensor(rng, [8, 16]) * 0.3, _rng_tensor(rng, [16, 8]) * 0.3

    @tf.function
    def step(x, y, w1, w2):
        with tf.GradientTape() as tape:
            err = tf.matmul(tf.nn.gelu(tf.matmul(x, w1)), w2) - y
            loss = tf.reduce_mean(err * err)
        g1, g2 = tape.gradient(loss, [w1, w2])
        w1.assign_sub(0.1 * g1)
        w2.assign_sub(0.1 * g2)
        return loss

    with mesh:
        x, y = mesh.shard(x0, ("batch", None)), mesh.shard(y0, ("batch", None))
        w1 = tf.Variable(mesh.shard(w10, (None, "model")))
        w2 = tf.Variable(mesh.shard(w20, ("model", None)))
    r1, r2 = tf.Variable(w10), tf.Variable(w20)
    for _ in range(3):
        with mesh:
            loss = step(x, y, w1, w2)
        assert_close(loss, step(x0, y0, r1, r2), 1e-5)
    assert mesh.layout_of(w1) == (None, "model") and mesh.layout_of(w2) == ("model", None)
    assert [s.shape.as_list() for s in mesh.unpack(w1.value())] == [[8, 8]] * 4
    assert_close(w1, r1, 1e-5)
    assert not mesh.fallbacks


def test_forward_accumulator_and_vectorized_map_on_sharded_values(mesh):
    rng = np.random.default_rng(0)
    x0, w0, t0 = _rng_tensor(rng, [4, 6]), _rng_tensor(rng, [6, 8]), _rng_tensor(rng, [6, 8])

    def f(x, w):
        return tf.reduce_sum(tf.tanh(tf.matmul(x, w)), axis=1)

    with tf.autodiff.ForwardAccumulator(w0, t0) as ref_acc:
        ref_y = f(x0, w0)
    with mesh:
        x, w = mesh.shard(x0, ("batch", None)), mesh.shard(w0, (None, "model"))
        with oh.ForwardAccumulator(w, mesh.shard(t0, (None, "model"))) as acc:
            y = f(x, w)
        jvp = acc.jvp(y)
        assert mesh.layout_of(jvp) == ("batch",)
        per_example = oh.vectorized_map(
            lambda e: tf.tanh(tf.linalg.matvec(w, e, transpose_a=True)), x)
        assert mesh.layout_of(per_example) == ("batch", "model")
    assert_close(y, ref_y, 1e-5)
    assert_close(jvp, ref_acc.jvp(ref_y), 1e-5)
    assert_close(per_example, tf.tanh(tf.matmul(x0, w0)), 1e-5)
    assert not mesh.fallbacks


def test_embedding_sharded_on_vocabulary_trains(mesh):
    rng = np.random.default_rng(0)
    table = _rng_tensor(rng, [8, 4])
    ids = tf.constant([[0, 7, 3], [5, 5, 1], [2, 6, 4], [1, 0, 7]])
    ref = tf.Variable(table)
    with mesh:
        emb = tf.Variable(mesh.shard(table, ("model", None)))
    for _ in range(2):
        with mesh:
            with oh.GradientTape() as tape:
                loss = tf.reduce_sum(tf.gather(emb, mesh.shard(ids, ("batch", None))) ** 2)
            grad = tape.gradient(loss, emb)
            assert isinstance(grad, tf.IndexedSlices)  # as tf.GradientTape gives
            emb.assign_sub(0.1 * tf.convert_to_tensor(grad))
        with tf.GradientTape() as tape:
            ref_loss = tf.reduce_sum(tf.gather(ref, ids) ** 2)
        ref_grad = tape.gradient(ref_loss, ref)
        ref.assign_sub(0.1 * tf.convert_to_tensor(ref_grad))
        assert_close(loss, ref_loss, 1e-5)
    assert_close(emb, ref, 1e-5)
    assert mesh.layout_of(emb) == ("model", None)
    assert not mesh.fallbacks


def test_keras_conv2d_on_the_batch_axis(mesh):
    def build():
        return keras.Sequential([
            keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.MaxPooling2D(), keras.layers.AveragePooling2D(2),
            keras.layers.Flatten(), keras.layers.Dense(2)])
    with mesh:
        model = build()
    ref = build()
    ref.set_weights(model.get_weights())
    x = np.random.default_rng(0).normal(size=(4, 8, 8, 3)).astype("float32")
    with mesh:
        with oh.GradientTape() as tape:
            loss = tf.reduce_sum(model(mesh.shard(x, ("batch", None, None, None))) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
    with tf.GradientTape() as tape:
        ref_loss = tf.reduce_sum(ref(x) ** 2)
    assert_close(loss, ref_loss, 1e-5)
    for g, r in zip(grads, tape.gradient(ref_loss, ref.trainable_variables)):
        assert_close(g, r, 1e-5)
    assert not mesh.fallbacks


def test_mesh_passes_the_conformance_kit():
    report = oh.testing.check_handler(lambda: oh.Mesh({"batch": 2}, DEVICES[:2]))
    assert report.checks and not report.failures, report.failures


# -- scale out: a mesh over two tf.distribute.Server processes (loopback) ----------------

_SERVER = r'''
import sys, time, tensorflow as tf
cluster = tf.train.ClusterSpec({"worker": sys.argv[1].split(",")})
config = tf.compat.v1.ConfigProto(device_count={"CPU": 2})
server = tf.distribute.Server(cluster, job_name="worker", task_index=int(sys.argv[2]), config=config, start=True)
print("ready", flush=True)
server.join()
'''

_CLIENT = r'''
import socket, subprocess, sys, os, time
def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
addrs = ["127.0.0.1:%d" % free_port() for _ in range(2)]
procs = [subprocess.Popen([sys.executable, sys.argv[1], ",".join(addrs), str(i)], stdout=subprocess.PIPE, text=True) for i in range(2)]
try:
    for p in procs: p.stdout.readline()
    import numpy as np, tensorflow as tf
    import tf_ophandlers as oh
    tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec({"worker": addrs}))
    devices = ["/job:worker/replica:0/task:%d/device:CPU:%d" % (t, c) for t in range(2) for c in range(2)]
    mesh = oh.Mesh({"batch": 2, "model": 2}, devices)
    rng = np.random.default_rng(0)
    x0, y0 = rng.normal(size=[8, 8]).astype("float32"), rng.normal(size=[8, 8]).astype("float32")
    w10, w20 = (rng.normal(size=[8, 16]) * .3).astype("float32"), (rng.normal(size=[16, 8]) * .3).astype("float32")
    def loss_fn(x, y, w1, w2):
        err = tf.matmul(tf.nn.gelu(tf.matmul(x, w1)), w2) - y
        return tf.reduce_mean(err * err)
    with mesh:
        x, y = mesh.shard(x0, ("batch", None)), mesh.shard(y0, ("batch", None))
        w1 = tf.Variable(mesh.shard(w10, (None, "model"))); w2 = tf.Variable(mesh.shard(w20, ("model", None)))
    r1, r2 = tf.Variable(w10), tf.Variable(w20)
    for step in range(5):
        with mesh:
            with oh.GradientTape() as tape:
                loss = loss_fn(x, y, w1, w2)
            g1, g2 = tape.gradient(loss, [w1, w2])
            w1.assign_sub(0.1 * g1); w2.assign_sub(0.1 * g2)
        with tf.GradientTape() as tape:
            ref = loss_fn(x0, y0, r1, r2)
        h1, h2 = tape.gradient(ref, [r1, r2]); r1.assign_sub(0.1 * h1); r2.assign_sub(0.1 * h2)
        print("loss", float(loss), float(ref))
    print("devices", [s.device for s in mesh.unpack(w1.value())])
    print("fallbacks", dict(mesh.fallbacks))
finally:
    for p in procs: p.kill()
'''


@pytest.mark.slow
def test_training_on_a_mesh_over_two_server_processes(tmp_path):
    """Two tf.distribute.Server processes with two CPUs each form the 2x2 mesh; a client
    process trains the Megatron MLP step on it with the single-device losses."""
    (tmp_path / "server.py").write_text(_SERVER)
    proc = run_python(_CLIENT, args=[tmp_path / "server.py"], timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [[float(v) for v in line.split()[1:]] for line in proc.stdout.splitlines()
              if line.startswith("loss ")]
    assert len(losses) == 5
    np.testing.assert_allclose(*np.array(losses).T, rtol=1e-5)
    assert "task:1/device:CPU:1" in proc.stdout and "fallbacks {}" in proc.stdout
