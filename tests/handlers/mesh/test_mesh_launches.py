"""What oh.Mesh issues per sharded op (load-independent counts, mesh/comm.py) on a 2x2
("batch", "model") mesh of four logical CPUs, with values against plain TensorFlow;
the communication nodes of a replayed function and a mesh that copies shards."""
import collections

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from conftest import assert_close
from tf_ophandlers.core.functions import call as function_calls
from tf_ophandlers.handlers.mesh import comm as mesh_comm

DEVICES = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]


@pytest.fixture
def mesh():
    return oh.Mesh({"batch": 2, "model": 2}, DEVICES)


@pytest.fixture
def launched(monkeypatch):
    """Counts the eager ops oh.Mesh launches on TensorFlow's devices, by type."""
    counts = collections.Counter()
    run = mesh_comm.execute_physical

    def counting(op, inputs, device):
        counts[op.type] += 1
        return run(op, inputs, device)

    monkeypatch.setattr(mesh_comm, "execute_physical", counting)
    return counts


def _values(rng, *shapes):
    return [rng.normal(size=s).astype("float32") for s in shapes]


CASES = [  # fn, layouts, shapes, eager ops per call
    (lambda a, b: a * b, [("batch", "model")] * 2, [[8, 6], [8, 6]], {"Mul": 4}),
    # Small float products launch as BatchMatMulV3 (mesh_rules._small_matmul).
    (tf.matmul, [("batch", None), (None, "model")], [[8, 6], [6, 4]],
     {"BatchMatMulV3": 4}),
    # Partial sums over "model": both inputs are replicated over "batch" (devices (0, m)
    # and (1, m) share their shards), so one MatMul per "model" coordinate and one AddN,
    # read in place by every device.
    (tf.matmul, [(None, "model"), ("model", None)], [[8, 6], [6, 4]],
     {"BatchMatMulV3": 2, "AddN": 1}),
    # A reduction over sharded axes combines the group's shards first (one AddN), then
    # reduces the group's shared sum once.
    (lambda a, b: tf.reduce_sum(a), [("batch", "model")] * 2, [[8, 6], [8, 6]],
     {"Sum": 1, "AddN": 1}),
    (lambda a, b: tf.reduce_max(a, 1), [("batch", "model")] * 2, [[8, 6], [8, 6]],
     {"Max": 2, "Maximum": 2}),
    # A mean over a sharded axis: per "batch" group, AddN, Mean, one division.
    (lambda a, b: tf.reduce_mean(a, 0), [("batch", "model")] * 2, [[8, 6], [8, 6]],
     {"Mean": 2, "AddN": 2, "RealDiv": 2}),
    (lambda a, b: tf.reduce_mean(a, 1, keepdims=True), [("batch", "model")] * 2,
     [[8, 6], [8, 6]], {"Mean": 2, "AddN": 2, "RealDiv": 2}),
    # Not over a sharded axis: one Mean per device, no communication.
    (lambda a, b: tf.reduce_mean(a, 1), [("batch", None)] * 2, [[8, 6], [8, 6]],
     {"Mean": 2}),
    # Relayout onto a mesh dimension: one Slice per device.
    (lambda a, b: a + b, [("batch", "model"), (None, None)], [[8, 6], [8, 6]],
     {"Slice": 4, "AddV2": 4}),
    # Replicated over "batch": a Slice and an AddV2 per "model" coordinate, shared.
    (lambda a, b: a + b, [(None, "model"), (None, None)], [[8, 6], [8, 6]],
     {"Slice": 2, "AddV2": 2}),
]


@pytest.mark.parametrize("fn, layouts, shapes, ops", CASES)
def test_eager_ops_per_sharded_op(mesh, launched, fn, layouts, shapes, ops):
    a0, b0 = _values(np.random.default_rng(0), *shapes)
    with mesh:
        a, b = mesh.shard(a0, layouts[0]), mesh.shard(b0, layouts[1])
        launched.clear()
        out = fn(a, b)
        assert dict(launched) == ops, launched
    assert_close(out, fn(a0, b0), 1e-5)
    assert not mesh.fallbacks


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
@pytest.mark.parametrize("ta, tb", [(False, False), (True, False), (False, True),
                                    (True, True)])
@pytest.mark.parametrize("m, k, n", [(8, 6, 4), (256, 128, 256)])
def test_small_real_matmuls_launch_as_batch_matmul_v3(
        mesh, launched, dtype, ta, tb, m, k, n):
    """Per device m/2 x k x n/2 multiply-adds: BatchMatMulV3 up to 2**20 for float32 and
    float64 (transposes as adjoints), else TensorFlow's MatMul; the same values and
    dtype as tf.matmul either way, and a tape's gradients too."""
    rng = np.random.default_rng(2)
    a0 = tf.constant(rng.integers(-3, 4, size=[m, k] if not ta else [k, m]), dtype)
    b0 = tf.constant(rng.integers(-3, 4, size=[k, n] if not tb else [n, k]), dtype)
    want = tf.matmul(a0, b0, transpose_a=ta, transpose_b=tb)
    with mesh:
        a = mesh.shard(a0, (None, "batch") if ta else ("batch", None))
        b = mesh.shard(b0, ("model", None) if tb else (None, "model"))
        launched.clear()
        got = tf.matmul(a, b, transpose_a=ta, transpose_b=tb)
        small = dtype != "int32" and (m // 2) * k * (n // 2) <= 1 << 20
        assert dict(launched) == {"BatchMatMulV3" if small else "MatMul": 4}, launched
        assert mesh.layout_of(got) == ("batch", "model")
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    if dtype == "float32" and small:
        with mesh:
            with oh.GradientTape() as tape:
                tape.watch([a, b])
                y = tf.reduce_sum(tf.matmul(a, b, transpose_a=ta, transpose_b=tb) ** 2)
            ga, gb = tape.gradient(y, [a, b])
        with tf.GradientTape() as ref:
            ref.watch([a0, b0])
            y0 = tf.reduce_sum(tf.matmul(a0, b0, transpose_a=ta, transpose_b=tb) ** 2)
        for g, g0 in zip([ga, gb], ref.gradient(y0, [a0, b0])):
            assert_close(g, g0, 1e-5)


def test_reduced_values_are_read_in_place_and_unpacked_on_their_devices(mesh, launched):
    a0, b0 = _values(np.random.default_rng(1), [4, 6], [6, 8])
    with mesh:
        a, b = mesh.shard(a0, (None, "model")), mesh.shard(b0, ("model", None))
        y = tf.matmul(a, b) * 2.
        assert "Identity" not in launched
        shards = mesh.unpack(y)
    assert [s.device.rsplit(":", 1)[-1] for s in shards] == ["0", "1", "2", "3"]
    for s in shards:
        assert_close(s, tf.matmul(a0, b0) * 2., 1e-5)


def test_replicated_stateless_ops_on_shared_inputs_run_once(mesh, launched):
    with mesh:
        x = mesh.shard(tf.fill([3, 3], 2.), (None, None))
        launched.clear()
        y = tf.exp(x)
        assert dict(launched) == {"Exp": 1}
    assert_close(y, tf.exp(tf.fill([3, 3], 2.)), 1e-6)


def test_a_mesh_that_copies_shards_gives_the_same_values(mesh, launched):
    mesh.shares_host_memory = False  # as for GPUs or tasks of a cluster
    a0, b0 = _values(np.random.default_rng(2), [4, 6], [6, 8])
    with mesh:
        a, b = mesh.shard(a0, (None, "model")), mesh.shard(b0, ("model", None))
        launched.clear()
        y = tf.matmul(a, b)
        assert launched["Identity"] == 2 and launched["AddN"] == 2, launched
        shards = mesh.unpack(y)
        launched.clear()
        m = tf.reduce_mean(a, 1)  # reduced per device, then all-reduced and copied
        assert launched["Mean"] == 4 and launched["AddN"] == 2, launched
    assert [s.device.rsplit(":", 1)[-1] for s in shards] == ["0", "1", "2", "3"]
    assert_close(y, tf.matmul(a0, b0), 1e-5)
    assert_close(m, tf.reduce_mean(a0, 1), 1e-5)


def test_host_memory_devices():
    local = ["/job:localhost/replica:0/task:0/device:CPU:%d" % i for i in range(2)]
    assert mesh_comm.host_memory_devices(local)
    assert not mesh_comm.host_memory_devices(
        ["/job:worker/replica:0/task:%d/device:CPU:0" % i for i in range(2)])
    assert not mesh_comm.host_memory_devices(
        ["/job:localhost/replica:0/task:0/device:GPU:%d" % i for i in range(2)])


def test_replayed_function_places_its_communication_and_copies_nothing(mesh):
    rng = np.random.default_rng(3)
    x0, y0, w10 = _values(rng, [8, 8], [8, 4], [8, 4])

    @tf.function
    def step(x, y, w):
        with tf.GradientTape() as tape:
            err = tf.matmul(x, w) - y
            loss = tf.reduce_mean(err * err)
        w.assign_sub(0.1 * tape.gradient(loss, w))
        return loss

    with mesh:
        x, y = mesh.shard(x0, ("batch", "model")), mesh.shard(y0, ("batch", None))
        w = tf.Variable(mesh.shard(w10, ("model", None)))
    r = tf.Variable(w10)
    before = set(function_calls._cache)  # pylint: disable=protected-access
    for _ in range(2):
        with mesh:
            loss = step(x, y, w)
        assert_close(loss, step(x0, y0, r), 1e-5)
    assert_close(w, r, 1e-5)
    (key,) = [k for k in function_calls._cache if k not in before]  # pylint: disable=protected-access
    nodes = function_calls._cache[key].compiled.function.function_def.node_def  # pylint: disable=protected-access
    comm = [n for n in nodes if n.op in ("AddN", "Slice", "ConcatV2", "RealDiv")]
    assert comm and all(n.device for n in comm), [(n.op, n.device) for n in comm]
    # Identities only at the function's outputs (none between devices).
    assert sum(n.op == "Identity" for n in nodes) <= 8
    # Every device reads its own copy of a constant (the traced body's 0.1, slice bounds,
    # a mean's divisor): no constant crosses devices (a Send/Recv pair each).
    by_name = {n.name: n for n in nodes}
    sources = [(by_name.get(i.split(":")[0]), n) for n in nodes for i in n.input
               if not i.startswith("^")]
    crossing = [(s.name, n.name) for s, n in sources
                if s is not None and s.op == "Const" and s.device != n.device]
    assert not crossing, crossing
    assert not mesh.fallbacks


def _square_plus_one(mesh):
    """(a0, shards of a * a + 1 unpacked, fast-path ops counted for the two ops)."""
    import tf_ophandlers._C as native  # pylint: disable=import-outside-toplevel
    a0 = np.arange(24, dtype=np.float32).reshape(4, 6)
    with mesh:
        a = mesh.shard(a0, ("batch", "model"))
        before = native.fast_stats()["fast_ops"]
        b = a * a + 1.
        ran_fast = native.fast_stats()["fast_ops"] - before
        shards = mesh.unpack(b)  # only ParallelUnpack
    return a0, shards, ran_fast


def test_mesh_ops_give_the_values_and_unpack_leaves_the_stack(mesh):
    a0, shards, _ = _square_plus_one(mesh)
    assert oh.handler_of(shards[0]) is None
    assert_close(tf.concat([tf.concat(shards[:2], 1), tf.concat(shards[2:], 1)], 0),
                 a0 * a0 + 1., 1e-6)


@pytest.mark.requires_c_paths("mesh ops take the C++ per-op path")
def test_mesh_ops_take_the_cpp_per_op_path_and_unpack_still_leaves_the_stack(mesh):
    _, shards, ran_fast = _square_plus_one(mesh)
    assert ran_fast >= 2  # returns_off_stack names
    assert oh.handler_of(shards[0]) is None


def test_replayed_rule_ops_made_with_tensorflow_calls_are_placed_per_device(mesh):
    """A vocabulary-sharded gather's masks are TensorFlow calls under mesh.on_device(i)
    (core places them, mesh adds no graph device scope of its own): each device's mask
    ops become nodes on that device."""
    params0 = np.arange(32, dtype=np.float32).reshape(8, 4)
    ids0 = np.array([[0, 7], [3, 4]], dtype=np.int32)

    @tf.function
    def lookup(params, ids):
        return tf.gather(params, ids) * 2.

    with mesh:
        params = mesh.shard(params0, ("model", None))
        ids = mesh.shard(ids0, ("batch", None))
    before = set(function_calls._cache)  # pylint: disable=protected-access
    with mesh:
        got = lookup(params, ids)
    assert_close(got, tf.gather(params0, ids0) * 2., 1e-6)
    (key,) = [k for k in function_calls._cache if k not in before]  # pylint: disable=protected-access
    nodes = function_calls._cache[key].compiled.function.function_def.node_def  # pylint: disable=protected-access
    masks = [n for n in nodes if n.op in ("LogicalAnd", "SelectV2", "GreaterEqual")]
    assert masks and all(n.device for n in masks), [(n.op, n.device) for n in masks]
    by_device = collections.Counter(n.device.rsplit(":", 1)[-1] for n in masks
                                    if n.op == "LogicalAnd")
    assert sorted(by_device) == ["0", "1", "2", "3"], by_device
    assert not mesh.fallbacks


def test_shared_shards_cross_a_replay_once_and_join_unshared_in_control_flow(mesh):
    """A value whose devices share shards ("batch" rows, replicated over "model") enters
    a replayed function as its distinct shards; where it meets in a cond a value of the
    same layout with a shard per device (a variable's reads), the two join unshared."""
    x0 = np.arange(24, dtype=np.float32).reshape(4, 6)
    v0 = x0 * 10.

    @tf.function
    def pick(flag, x, v):
        return tf.cond(flag, lambda: x * 2., lambda: v.read_value()) + 1.

    with mesh:
        x = mesh.shard(x0, ("batch", None))
        v = tf.Variable(mesh.shard(v0, ("batch", None)))
        shards = mesh.unpack(x)
    assert mesh.function_input(mesh._value_of(x))[0][3] == (0, 0, 1, 1)  # pylint: disable=protected-access
    del shards
    for flag, want in ((True, x0 * 2. + 1.), (False, v0 + 1.)):
        with mesh:
            got = pick(tf.constant(flag), x, v)
            assert mesh.layout_of(got) == ("batch", None)
        assert_close(got, want, 1e-6)
    assert not mesh.fallbacks


def test_broadcasting_plans_are_cached_per_layouts_and_shapes(mesh, monkeypatch):
    """An elementwise op with broadcasting (a bias add, a scalar scale) decides its
    layouts once per (layouts, shapes) of its inputs; another op type reuses the plan."""
    from tf_ophandlers.handlers.mesh import (  # pylint: disable=import-outside-toplevel
        rules as mesh_rules)
    plans = []
    real = mesh_rules._broadcast_plan  # pylint: disable=protected-access
    monkeypatch.setattr(mesh_rules, "_broadcast_plan",
                        lambda inputs: plans.append(1) or real(inputs))
    mesh_rules._broadcast_plans.clear()  # pylint: disable=protected-access
    rng = np.random.default_rng(4)
    x0, b0 = _values(rng, [4, 6], [6])
    with mesh:
        x, b = mesh.shard(x0, ("batch", None)), mesh.shard(b0, ("model",))
        for _ in range(3):
            y = x + b
            z = x * b
    assert_close(y, x0 + b0, 1e-6)
    assert_close(z, x0 * b0, 1e-6)
    assert mesh.layout_of(y) == ("batch", "model")
    assert len(plans) == 1


def test_replayed_constants_placed_per_device_are_kept_by_their_graph_only(mesh):
    """The per-device copies of a replayed body's constants live on the graph being built:
    no process-wide cache holds a tensor of a replay's graph (it would keep every replayed
    graph alive, and hand a symbolic tensor to a later replay with a reused id)."""
    from tf_ophandlers.core import cache as cache_module

    @tf.function
    def scaled(x):
        return x * 3. + 1.

    with mesh:
        x = mesh.shard(np.arange(16, dtype=np.float32).reshape(4, 4), ("batch", "model"))
        got = scaled(x)
    assert_close(got, np.arange(16, dtype=np.float32).reshape(4, 4) * 3. + 1., 1e-6)
    held = {}
    for c in list(cache_module._all.values()):  # pylint: disable=protected-access
        for v in list(c.values()):
            for t in (v if isinstance(v, (list, tuple)) else (v,)):
                if isinstance(t, tf.Tensor) and not hasattr(t, "numpy"):
                    held[c.name] = held.get(c.name, 0) + 1
    assert not held, "caches holding graph tensors: %s" % held
