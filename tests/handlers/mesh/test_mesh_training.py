"""oh.Mesh in the training loops users write: partial last batches (an axis that does not
divide stays replicated), Keras optimizers (slot variables take their variables'
layouts), `model.fit`; against single-device TensorFlow on the same inputs."""
import gc
import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers.core import functions
from conftest import assert_close

DEVICES = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
LAYOUTS = {"dense/kernel": (None, "model"), "dense/bias": ("model",),
           "dense_1/kernel": ("model", None), "dense_1/bias": (None,)}


@pytest.fixture
def mesh():
    return oh.Mesh({"batch": 2, "model": 2}, DEVICES)


def _data(n=11):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 8)).astype("float32"), rng.normal(size=(n, 4)).astype("float32")


def _mlp():
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu",
                                                                   name="dense"),
                             keras.layers.Dense(4, name="dense_1")])


def _sharded_mlp(mesh):
    keras.utils.set_random_seed(0)  # (Adam's update of a near-zero gradient amplifies
    # float rounding differences: fixed weights keep the 1e-5 comparisons reproducible)
    with mesh:
        model = _mlp()
    ref = _mlp()
    ref.set_weights(model.get_weights())
    for v in model.trainable_variables:
        layout = LAYOUTS[v.path.split("/", 1)[1]]
        if any(layout):
            mesh.shard_variable(v, layout)
    return model, ref


def test_uneven_shard_keeps_the_axis_replicated_and_reports_once(mesh, caplog):
    x = tf.reshape(tf.range(18.), [3, 6])
    with caplog.at_level(logging.WARNING, logger="tf_ophandlers"):
        with mesh:
            s = mesh.shard(x, ("batch", "model"))
            r = mesh.relayout(mesh.shard(tf.ones([5, 4]), ("batch", None)), (None, "model"))
            t = mesh.relayout(r, ("batch", "model"))
    assert mesh.layout_of(s) == (None, "model")
    assert [p.shape.as_list() for p in mesh.unpack(s)] == [[3, 3]] * 4
    assert_close(s, x)
    assert mesh.layout_of(r) == (None, "model") and mesh.layout_of(t) == (None, "model")
    assert mesh.uneven["batch"] == 3 and "model" not in mesh.uneven
    assert sum("does not divide" in r.getMessage() for r in caplog.records) == 1


def test_partial_last_batch_eager_and_in_a_replayed_step_with_unknown_batch_dim(mesh):
    """11 examples in batches of 4: the last batch of 3 runs replicated on "batch" and
    gives TensorFlow's loss, eagerly (Keras MLP, oh.GradientTape) and in a tf.function
    whose input_signature leaves the batch dimension unknown."""
    x_all, y_all = _data()
    ds = tf.data.Dataset.from_tensor_slices((x_all, y_all)).batch(4)
    model, ref = _sharded_mlp(mesh)
    sizes = []
    for x, y in ds:
        with mesh:
            xs, ys = mesh.shard(x, ("batch", None)), mesh.shard(y, ("batch", None))
            with oh.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xs) - ys))
            for v, g in zip(model.trainable_variables,
                            tape.gradient(loss, model.trainable_variables)):
                assert mesh.layout_of(g) == mesh.layout_of(v)
                v.assign_sub(0.1 * g)
        with tf.GradientTape() as tape:
            ref_loss = tf.reduce_mean(tf.square(ref(x) - y))
        for v, g in zip(ref.trainable_variables, tape.gradient(ref_loss,
                                                               ref.trainable_variables)):
            v.assign_sub(0.1 * g)
        assert_close(loss, ref_loss, 1e-5)
        sizes.append(int(x.shape[0]))
    assert sizes == [4, 4, 3]

    spec = [tf.TensorSpec([None, 8]), tf.TensorSpec([None, 4])]

    def make_step(w1, w2):
        @tf.function(input_signature=spec)
        def step(x, y):
            with tf.GradientTape() as tape:
                err = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2) - y
                loss = tf.reduce_mean(err * err)
            g1, g2 = tape.gradient(loss, [w1, w2])
            w1.assign_sub(0.1 * g1)
            w2.assign_sub(0.1 * g2)
            return loss
        return step

    w10, w20 = model.layers[0].kernel.numpy(), model.layers[1].kernel.numpy()
    with mesh:
        w1 = tf.Variable(mesh.shard(w10, (None, "model")))
        w2 = tf.Variable(mesh.shard(w20, ("model", None)))
    r1, r2 = tf.Variable(w10), tf.Variable(w20)
    step, ref_step = make_step(w1, w2), make_step(r1, r2)
    for _ in range(2):
        for x, y in ds:
            with mesh:
                loss = step(mesh.shard(x, ("batch", None)), mesh.shard(y, ("batch", None)))
            assert_close(loss, ref_step(x, y), 1e-5)
    assert_close(w1, r1, 1e-5)
    assert mesh.layout_of(w1) == (None, "model")
    assert [s.shape.as_list() for s in mesh.unpack(w1.value())] == [[8, 8]] * 4
    assert mesh.uneven["batch"] > 0
    assert not mesh.fallbacks


def _slot_layouts(mesh, optimizer, model):
    """{slot path: (its layout, its variable's layout)} for the Keras optimizer's slots."""
    out = {}
    for v in model.trainable_variables:
        prefix = v.path.replace("/", "_") + "_"
        for s in optimizer.variables:
            if s.path.split("/")[-1].startswith(prefix):
                out[s.path] = (mesh.layout_of(s), mesh.layout_of(v))
    return out


def _assert_slots_sharded_like_their_variables(mesh, optimizer, model, per_variable):
    slots = _slot_layouts(mesh, optimizer, model)
    assert len(slots) == per_variable * len(model.trainable_variables)
    for path, (layout, var_layout) in slots.items():
        assert layout == var_layout, path
    kernel_slot = next(s for s in optimizer.variables
                       if s.path.endswith("dense_kernel_momentum"))
    shards = mesh.unpack(kernel_slot.value)  # each device holds half of it
    assert [s.shape.as_list() for s in shards] == [[8, 8]] * 4


def test_keras_adam_eager_steps_shard_slot_variables_like_their_variables(mesh):
    x, y = _data(8)
    model, ref = _sharded_mlp(mesh)
    with mesh:
        opt = keras.optimizers.Adam(0.01)
    ref_opt = keras.optimizers.Adam(0.01)
    for _ in range(4):
        with mesh:
            xs, ys = mesh.shard(x, ("batch", None)), mesh.shard(y, ("batch", None))
            with oh.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xs) - ys))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                    model.trainable_variables))
        with tf.GradientTape() as tape:
            ref_loss = tf.reduce_mean(tf.square(ref(x) - y))
        ref_opt.apply_gradients(zip(tape.gradient(ref_loss, ref.trainable_variables),
                                    ref.trainable_variables))
        assert_close(loss, ref_loss, 1e-5)
    for v, r in zip(model.trainable_variables, ref.trainable_variables):
        assert_close(v, r, 1e-5)
    slots = _slot_layouts(mesh, opt, model)
    assert len(slots) == 8  # momentum and velocity of four variables
    for path, (layout, var_layout) in slots.items():
        assert layout == var_layout, path
    kernel_slot = next(s for s in opt.variables if s.path.endswith("dense_kernel_momentum"))
    shards = mesh.unpack(kernel_slot.value)  # each device holds half of it
    assert [s.shape.as_list() for s in shards] == [[8, 8]] * 4
    for s, r in zip(opt.variables, ref_opt.variables):
        assert_close(s, r, 1e-5)
    assert not mesh.fallbacks


def test_keras_adam_in_a_replayed_tf_function_step(mesh):
    x, y = _data(8)
    model, ref = _sharded_mlp(mesh)
    with mesh:
        opt = keras.optimizers.Adam(0.01)
        opt.build(model.trainable_variables)  # slots made eagerly, in the mesh
    ref_opt = keras.optimizers.Adam(0.01)

    def make_step(model, opt):
        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                    model.trainable_variables))
            return loss
        return step

    step, ref_step = make_step(model, opt), make_step(ref, ref_opt)
    for _ in range(3):
        with mesh:
            loss = step(mesh.shard(x, ("batch", None)), mesh.shard(y, ("batch", None)))
        assert_close(loss, ref_step(x, y), 1e-5)
    for v, r in zip(model.trainable_variables, ref.trainable_variables):
        # Adam's m / sqrt(v) amplifies the rounding of partial sums added in another
        # order on near-zero gradients (one element off by 1e-5 after three steps)
        assert_close(v, r, 1e-4)
        assert mesh.layout_of(v) == LAYOUTS[v.path.split("/", 1)[1]]
    # the slots, built replicated, take their variables' layouts after the first call
    _assert_slots_sharded_like_their_variables(mesh, opt, model, 2)
    for s, r in zip(opt.variables, ref_opt.variables):
        assert_close(s, r, 1e-4)
    assert not mesh.fallbacks


def test_optimizer_variables_created_while_a_replayed_step_is_traced(mesh):
    """Without `optimizer.build`, Keras creates Adam's iteration counter and slots while
    the step is first traced and assigns their initial values in a cond of the step
    function: the layout the replay gives them there is the variables' own (the ops after
    the cond and the next calls see it), so the step trains like single-device Adam."""
    x, y = _data(8)
    model, ref = _sharded_mlp(mesh)

    def make_step(model, opt):
        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                    model.trainable_variables))
            return loss
        return step

    with mesh:
        opt = keras.optimizers.Adam(0.01)
    ref_opt = keras.optimizers.Adam(0.01)
    step, ref_step = make_step(model, opt), make_step(ref, ref_opt)
    for _ in range(3):
        with mesh:
            loss = step(mesh.shard(x, ("batch", None)), mesh.shard(y, ("batch", None)))
        assert_close(loss, ref_step(x, y), 1e-5)
    assert int(opt.iterations.numpy()) == 3
    for v, r in zip(model.trainable_variables, ref.trainable_variables):
        assert_close(v, r, 1e-4)  # (see the test above)
        assert mesh.layout_of(v) == LAYOUTS[v.path.split("/", 1)[1]]
    for s, r in zip(opt.variables, ref_opt.variables):
        assert_close(s, r, 1e-4)
    _assert_slots_sharded_like_their_variables(mesh, opt, model, 2)
    assert not mesh.fallbacks


def test_model_fit_run_eagerly_with_a_partial_batch(mesh):
    x, y = _data()
    model, ref = _sharded_mlp(mesh)
    with mesh:
        model.compile(keras.optimizers.Adam(0.01), "mse", run_eagerly=True)
    ref.compile(keras.optimizers.Adam(0.01), "mse")
    with mesh:
        history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    ref_history = ref.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"],
                               rtol=1e-5)
    for v, r in zip(model.trainable_variables, ref.trainable_variables):
        assert_close(v, r, 1e-5)
    assert mesh.layout_of(model.layers[0].kernel) == (None, "model")
    assert not mesh.fallbacks


class _BatchLosses(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        self.losses = getattr(self, "losses", []) + [logs["loss"]]


def _fit_both(mesh, model, ref, loss, x, y, epochs=2, optimizer=None, build=False,
              **compile_args):
    """Compiled fit (no run_eagerly) of `model` in the mesh's scope and of `ref` on one
    device, batches of 4 (a partial last one), `optimizer()` (Adam by default; built in
    the scope before fit with `build`, else Keras builds it while tracing the step); the
    per-batch losses of both."""
    optimizer = optimizer or (lambda: keras.optimizers.Adam(0.01))
    with mesh:
        model.compile(optimizer(), loss, **compile_args)
        if build:
            model.optimizer.build(model.trainable_variables)
    ref.compile(optimizer(), loss, **compile_args)
    got, want = _BatchLosses(), _BatchLosses()
    with mesh:
        history = model.fit(x, y, batch_size=4, epochs=epochs, shuffle=False, verbose=0,
                            callbacks=[got])
    ref_history = ref.fit(x, y, batch_size=4, epochs=epochs, shuffle=False, verbose=0,
                          callbacks=[want])
    assert not model.run_eagerly
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"],
                               rtol=1e-5)
    return got.losses, want.losses


def test_compiled_model_fit_without_optimizer_build_adam_and_sgd_momentum():
    """`model.compile(optimizer)` then `model.fit` in the mesh's scope, no
    `optimizer.build`: Keras creates the optimizer's variables while tracing the train
    step; losses per batch, weights and the optimizer's variables equal single-device
    Keras, for Adam (by name) and SGD with momentum, and the slots end sharded like
    their variables (after the first call)."""
    for name, optimizer in (("adam", lambda: "adam"),
                            ("sgd", lambda: keras.optimizers.SGD(0.05, momentum=0.9))):
        mesh = oh.Mesh({"batch": 2, "model": 2}, DEVICES, batch_dim="batch")
        x, y = _data()
        model, ref = _sharded_mlp(mesh)
        got, want = _fit_both(mesh, model, ref, "mse", x, y, optimizer=optimizer)
        assert len(got) == 6, name
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=name)
        for v, r in zip(model.trainable_variables, ref.trainable_variables):
            assert_close(v, r, 1e-4)
            assert mesh.layout_of(v) == LAYOUTS[v.path.split("/", 1)[1]]
        assert len(model.optimizer.variables) == len(ref.optimizer.variables) > 2
        for s, r in zip(model.optimizer.variables, ref.optimizer.variables):
            assert_close(s, r, 1e-4)
        assert int(model.optimizer.iterations.numpy()) == 6
        _assert_slots_sharded_like_their_variables(mesh, model.optimizer, model,
                                                   2 if name == "adam" else 1)
        assert not mesh.fallbacks, (name, mesh.fallbacks)


def test_compiled_model_fit_with_an_optimizer_made_outside_fails_before_any_write():
    """An optimizer created outside the mesh: compiled fit raises before any weight or
    optimizer variable is written; its advice (compile with a new optimizer made in the
    scope, nothing else) then trains like single-device Keras."""
    mesh = oh.Mesh({"batch": 2, "model": 2}, DEVICES, batch_dim="batch")
    x, y = _data()
    model, ref = _sharded_mlp(mesh)
    before = [v.numpy() for v in model.trainable_variables]
    outside = keras.optimizers.Adam(0.01)
    with mesh:
        model.compile(outside, "mse")
        with pytest.raises(oh.PlacementError, match=(
                r"oh.Mesh: Adam.apply would write variable .*iteration.*created outside "
                r".*nothing was written.*make a new one inside the scope")) as info:
            model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert "optimizer.build" not in str(info.value)
    for v, b in zip(model.trainable_variables, before):
        np.testing.assert_array_equal(v.numpy(), b)
    assert int(outside.iterations.numpy()) == 0
    got, want = _fit_both(mesh, model, ref, "mse", x, y)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for v, r in zip(model.trainable_variables, ref.trainable_variables):
        assert_close(v, r, 1e-4)
    _assert_slots_sharded_like_their_variables(mesh, model.optimizer, model, 2)
    assert not mesh.fallbacks, mesh.fallbacks


@pytest.mark.parametrize("batch_dim", ["batch", None])
def test_compiled_model_fit_replays_the_train_step_with_single_device_losses(batch_dim):
    """model.fit of a model compiled normally, in the mesh's scope: Keras's train step
    (a tf.function reading the batch from the dataset iterator) is replayed SPMD; the
    batch is read before the call and sharded on `batch_dim` (a partial last batch of 3
    kept replicated). Losses per batch, final weights and evaluate/predict equal
    single-device Keras."""
    mesh = oh.Mesh({"batch": 2, "model": 2}, DEVICES, batch_dim=batch_dim)
    x, y = _data()
    model, ref = _sharded_mlp(mesh)
    gc.collect()  # (an earlier test's functions, once collected, drop their replays)
    before = functions.cache_info()
    got, want = _fit_both(mesh, model, ref, "mse", x, y, build=True)
    assert len(got) == 6
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for v, r in zip(model.trainable_variables, ref.trainable_variables):
        assert_close(v, r, 1e-5)
        assert mesh.layout_of(v) == LAYOUTS[v.path.split("/", 1)[1]]
    # the first batch's replay (slots replicated, as built), then one per batch shape (4
    # and 3) with the slots sharded like their variables, reused by the second epoch
    assert functions.cache_info() - before == 3
    _assert_slots_sharded_like_their_variables(mesh, model.optimizer, model, 2)
    # the partial batch's x and y, once per epoch: sharded on "batch" where 4 divides
    assert mesh.uneven == ({"batch": 4} if batch_dim else {})
    with mesh:
        loss = model.evaluate(x, y, batch_size=4, verbose=0)
        pred = model.predict(x, batch_size=4, verbose=0)
    np.testing.assert_allclose(loss, ref.evaluate(x, y, batch_size=4, verbose=0), rtol=1e-5)
    np.testing.assert_allclose(pred, ref.predict(x, batch_size=4, verbose=0), rtol=1e-5,
                               atol=1e-6)
    assert not mesh.fallbacks, mesh.fallbacks


def test_compiled_model_fit_of_a_classifier_with_sharded_logits():
    """A Keras classifier with sparse categorical crossentropy from logits whose logits
    are sharded over the classes ("model"): compiled fit runs the sharded
    SparseSoftmaxCrossEntropyWithLogits rule in the replayed step, no gathers."""
    mesh = oh.Mesh({"batch": 2, "model": 2}, DEVICES, batch_dim="batch")

    def build():
        return keras.Sequential([keras.Input((8,)),
                                 keras.layers.Dense(16, activation="relu", name="dense"),
                                 keras.layers.Dense(6, name="dense_1")])
    keras.utils.set_random_seed(0)
    with mesh:
        model = build()
    ref = build()
    ref.set_weights(model.get_weights())
    layouts = {"dense/kernel": (None, "model"), "dense/bias": ("model",),
               "dense_1/kernel": (None, "model"), "dense_1/bias": ("model",)}
    for v in model.trainable_variables:
        mesh.shard_variable(v, layouts[v.path.split("/", 1)[1]])
    rng = np.random.default_rng(1)
    x = rng.normal(size=(10, 8)).astype("float32")
    y = rng.integers(0, 6, size=10).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    got, want = _fit_both(mesh, model, ref, loss, x, y, epochs=3)
    assert len(got) == 9
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert got[-1] < got[0]
    for v, r in zip(model.trainable_variables, ref.trainable_variables):
        assert_close(v, r, 1e-5)
        assert mesh.layout_of(v) == layouts[v.path.split("/", 1)[1]]
    assert not mesh.fallbacks, mesh.fallbacks


def test_compiled_model_fit_reading_batches_in_a_loop_gives_a_clear_error(mesh):
    """steps_per_execution > 1: Keras reads the batches in a while loop of the step
    function, which cannot be fetched ahead of the call."""
    x, y = _data()
    model, _ = _sharded_mlp(mesh)
    with mesh:
        model.compile(keras.optimizers.SGD(0.1), "mse", steps_per_execution=2)
        model.optimizer.build(model.trainable_variables)
        with pytest.raises(NotImplementedError,
                           match=r"oh.Mesh: op IteratorGetNextAsOptional .*loop or branch"
                                 r".*steps_per_execution=1"):
            model.fit(x, y, batch_size=4, epochs=1, verbose=0)


def test_compiled_per_op_calls_train_like_tensorflow():
    """oh.Mesh(compile_ops=True): each op's per-device shards run as one cached
    multi-device function; the Keras MLP trains with TensorFlow's losses and gradients."""
    from tf_ophandlers.core import cache
    mesh = oh.Mesh({"batch": 2, "model": 2}, DEVICES, compile_ops=True)
    x, y = _data(8)
    model, ref = _sharded_mlp(mesh)
    for _ in range(3):
        with mesh:
            xs, ys = mesh.shard(x, ("batch", None)), mesh.shard(y, ("batch", None))
            with oh.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xs) - ys))
            grads = tape.gradient(loss, model.trainable_variables)
            for v, g in zip(model.trainable_variables, grads):
                assert mesh.layout_of(g) == mesh.layout_of(v)
                v.assign_sub(0.1 * g)
        with tf.GradientTape() as tape:
            ref_loss = tf.reduce_mean(tf.square(ref(x) - y))
        ref_grads = tape.gradient(ref_loss, ref.trainable_variables)
        for v, g in zip(ref.trainable_variables, ref_grads):
            v.assign_sub(0.1 * g)
        assert_close(loss, ref_loss, 1e-5)
        for g, r in zip(grads, ref_grads):
            assert_close(g, r, 1e-5)
    entries, maxsize = cache.caches()["mesh.per_op_functions"]
    assert 0 < entries <= maxsize
    assert not mesh.fallbacks


def test_shard_inside_a_traced_function_is_applied_when_replayed(mesh):
    """mesh.shard/relayout inside a tf.function (unknown batch dim): the traced Identity
    carries the layout and the replay relayouts; an uneven batch stays replicated."""
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(8, 4)).astype("float32")
    with mesh:
        w = tf.Variable(mesh.shard(w0, (None, "model")))
    r = tf.Variable(w0)

    def make(v, shard):
        @tf.function(input_signature=[tf.TensorSpec([None, 8])])
        def f(x):
            with tf.GradientTape() as tape:
                y = tf.tanh(tf.matmul(shard(x, ("batch", None)), v))
                loss = tf.reduce_mean(y * y)
            return y, shard(y, (None, None)), loss, tape.gradient(loss, v)
        return f

    f = make(w, mesh.shard)
    ref = make(r, lambda t, layout: t)
    for n, layout in ((6, ("batch", "model")), (3, (None, "model"))):
        x = rng.normal(size=(n, 8)).astype("float32")
        with mesh:
            y, y_rep, loss, g = f(x)
        assert mesh.layout_of(y) == layout and mesh.layout_of(y_rep) == (None, None)
        assert mesh.layout_of(g) == (None, "model")
        for a, b in zip((y, y_rep, loss, g), ref(x)):
            assert_close(a, b, 1e-5)
    assert mesh.uneven["batch"] == 1
    assert not mesh.fallbacks


@pytest.mark.parametrize("layout", [("model", None), (None, "model"), (None, None),
                                    ("batch", "model")])
def test_sparse_updates_of_an_embedding_from_its_indexed_slices_gradient(mesh, layout):
    """scatter_sub of a tape's IndexedSlices gradient (a sparse SGD step), scatter_update
    and scatter_max on a mesh variable, against the same updates of a plain variable."""
    rng = np.random.default_rng(4)
    table0 = rng.normal(size=(8, 4)).astype("float32")
    ids = tf.constant([[1, 5], [5, 7], [0, 2]])
    with mesh:
        table = tf.Variable(mesh.shard(table0, layout))
    ref = tf.Variable(table0)
    for step in range(2):
        with mesh:
            with oh.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(tf.gather(table, ids)))
            grad = tape.gradient(loss, table)
            assert isinstance(grad, tf.IndexedSlices)
            table.scatter_sub(tf.IndexedSlices(0.1 * grad.values, grad.indices))
        with tf.GradientTape() as tape:
            loss_ref = tf.reduce_sum(tf.square(tf.gather(ref, ids)))
        g = tape.gradient(loss_ref, ref)
        ref.scatter_sub(tf.IndexedSlices(0.1 * g.values, g.indices))
        assert_close(loss, loss_ref, 1e-5)
        assert_close(table, ref, 1e-6)
    rows = tf.IndexedSlices(tf.constant(rng.normal(size=(3, 4)).astype("float32")),
                            tf.constant([6, 3, 1]))
    with mesh:
        table.scatter_update(rows)
        table.scatter_max(rows)
    ref.scatter_update(rows)
    ref.scatter_max(rows)
    assert_close(table, ref, 1e-6)
    assert mesh.layout_of(table) == layout
    assert not mesh.fallbacks
    with mesh, pytest.raises(tf.errors.InvalidArgumentError, match="out of range|not in"):
        table.scatter_add(tf.IndexedSlices(tf.ones([1, 4]), tf.constant([8])))
