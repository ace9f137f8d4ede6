"""TensorList ops in a function mapped by `oh.vectorized_map`: `tf.TensorArray` (eager, and
in a `tf.function` called from the map, where it is TensorList ops) and the raw list ops,
with lists created inside the map and outside it (loop invariant), against
`tf.vectorized_map` on the same function and inputs. A batched list is pfor's: one list
whose elements carry the batch dimension.

Where `tf.vectorized_map` 2.21 is wrong or fails, the reference is `tf.map_fn` (the
function run once per example): `TensorArray.gather` (pfor gives the batch second) and
per-example gradients through list reads (pfor's element shape of a list of unknown
element shape is a scalar one: "Tried to set a tensor with incompatible shape"), a
per-example index into a per-example list, a loop with per-example trip counts over
a TensorArray, lists that end with per-example lengths and a `dynamic_size` TensorArray
growing in a loop.
"""
import logging

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from conftest import assert_same_tensors

R = tf.raw_ops
F32 = tf.float32
XS = tf.reshape(tf.range(12, dtype=F32), [3, 4]) / 10.
IDX = tf.constant([0, 1, 0])
SHAPE = tf.constant([4])


@pytest.fixture
def no_loop_fallback(caplog):
    """Fails a test in which some op ran once per example (the handler's warning): list
    ops must be vectorized, and a tf.function using lists replayed."""
    caplog.set_level(logging.WARNING, logger="tf_ophandlers")
    yield
    loops = [r.getMessage() for r in caplog.get_records("call")
             if "once per example" in r.getMessage()]
    assert not loops, loops


def check(fn, elems=XS, fallback=True):
    want = tf.vectorized_map(fn, elems, fallback_to_while_loop=fallback)
    assert_same_tensors(want, oh.vectorized_map(fn, elems, fallback_to_while_loop=fallback))
    assert_same_tensors(want, tf.function(lambda e: oh.vectorized_map(
        fn, e, fallback_to_while_loop=fallback))(elems))


def check_map_fn(fn, elems=XS):
    """Against tf.map_fn, where tf.vectorized_map is wrong or fails."""
    got = oh.vectorized_map(fn, elems)
    spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape[1:], t.dtype), got)
    assert_same_tensors(tf.map_fn(fn, elems, fn_output_signature=spec), got)


def get(handle, index, shape=SHAPE):
    return R.TensorListGetItem(input_handle=handle, index=index, element_shape=shape,
                               element_dtype=F32)


def stack(handle, shape=SHAPE):
    return R.TensorListStack(input_handle=handle, element_shape=shape, element_dtype=F32)


# -- lists created in the map --------------------------------------------------------------

def push_pop(e):
    lst = R.EmptyTensorList(element_shape=SHAPE, max_num_elements=-1, element_dtype=F32)
    lst = R.TensorListPushBack(input_handle=lst, tensor=e)
    lst = R.TensorListPushBack(input_handle=lst, tensor=tf.sin(e) * 3.)
    popped, last = R.TensorListPopBack(input_handle=lst, element_shape=SHAPE,
                                       element_dtype=F32)
    return (stack(lst), last, get(lst, 0), stack(popped), R.TensorListLength(input_handle=popped),
            R.TensorListElementShape(input_handle=lst, shape_type=tf.int32))


def reserve_set(e):
    lst = R.TensorListReserve(element_shape=SHAPE, num_elements=3, element_dtype=F32)
    lst = R.TensorListSetItem(input_handle=lst, index=0, item=e)
    lst = R.TensorListSetItem(input_handle=lst, index=2, item=e * 2.)
    return stack(lst), get(lst, 1), get(lst, 2), R.TensorListLength(input_handle=lst)


def reserve_unknown_shape(e):
    # Element shape unknown until written (tf.TensorArray's default).
    lst = R.TensorListReserve(element_shape=-1, num_elements=2, element_dtype=F32)
    lst = R.TensorListSetItem(input_handle=lst, index=1, item=e)
    lst = R.TensorListSetItem(input_handle=lst, index=0, item=tf.exp(e))
    return stack(lst, -1), get(lst, 1, -1)


def from_tensor(e):
    lst = R.TensorListFromTensor(tensor=tf.stack([e, tf.cos(e), e * e]), element_shape=SHAPE)
    lst = R.TensorListPushBack(input_handle=lst, tensor=tf.ones([4]))  # an unbatched item
    concat, lengths = R.TensorListConcatV2(
        input_handle=lst, element_shape=SHAPE, leading_dims=tf.zeros([0], tf.int64),
        element_dtype=F32)
    return (stack(lst), get(lst, 3), concat, lengths,
            R.TensorListLength(input_handle=lst))


def unbatched_list_batched_item(e):
    # An unbatched list (no per-example value in it yet) receives a per-example item.
    lst = R.TensorListFromTensor(tensor=tf.ones([2, 4]), element_shape=SHAPE)
    lst = R.TensorListSetItem(input_handle=lst, index=1, item=e)
    return stack(lst), get(lst, 0)


def per_example_index_read(e, i):
    lst = R.TensorListFromTensor(tensor=tf.stack([e, -e]), element_shape=SHAPE)
    return get(lst, i)


@pytest.mark.parametrize("fallback", [True, False], ids=["fallback", "no_fallback"])
@pytest.mark.parametrize("fn", [push_pop, reserve_set, reserve_unknown_shape, from_tensor,
                                unbatched_list_batched_item], ids=lambda f: f.__name__)
def test_lists_created_in_the_map_match_tf_vectorized_map(fn, fallback, no_loop_fallback):
    check(fn, fallback=fallback)


def test_per_example_index_into_a_per_example_list(no_loop_fallback):
    # (tf.vectorized_map fails: pfor's converter gives its tf.map_fn the wrong dtype.)
    check_map_fn(lambda a: per_example_index_read(*a), (XS, IDX))


# -- lists created outside the map (loop invariant) ------------------------------------------

OUTSIDE = R.TensorListFromTensor(tensor=tf.reshape(tf.range(8, dtype=F32), [2, 4]),
                                 element_shape=SHAPE)


def read_outside(e, i):
    return get(OUTSIDE, 1) + e, get(OUTSIDE, i) * e, stack(OUTSIDE) + e


def write_outside(e, i):
    written = R.TensorListSetItem(input_handle=OUTSIDE, index=0, item=e)
    pushed = R.TensorListPushBack(input_handle=OUTSIDE, tensor=e * 2.)
    return stack(written), stack(pushed), get(pushed, 2), R.TensorListLength(input_handle=pushed)


@pytest.mark.parametrize("fallback", [True, False], ids=["fallback", "no_fallback"])
@pytest.mark.parametrize("fn", [read_outside, write_outside], ids=lambda f: f.__name__)
def test_lists_created_outside_the_map_match_tf_vectorized_map(fn, fallback,
                                                               no_loop_fallback):
    check(lambda a: fn(*a), (XS, IDX), fallback=fallback)
    # the list outside is unchanged
    assert_same_tensors(tf.reshape(tf.range(8, dtype=F32), [2, 4]), stack(OUTSIDE))


@pytest.mark.parametrize("fallback", [True, False], ids=["fallback", "no_fallback"])
def test_a_write_at_a_per_example_index_raises_as_in_tensorflow(fallback):
    def fn(a):
        e, i = a
        lst = R.TensorListReserve(element_shape=SHAPE, num_elements=2, element_dtype=F32)
        return stack(R.TensorListSetItem(input_handle=lst, index=i, item=e))

    with pytest.raises(ValueError, match="loop variant indices"):
        tf.vectorized_map(fn, (XS, IDX), fallback_to_while_loop=fallback)
    with pytest.raises(ValueError, match="oh.vectorized_map: TensorList op TensorListSetItem "
                       ".*loop variant indices"):
        oh.vectorized_map(fn, (XS, IDX), fallback_to_while_loop=fallback)


# -- tf.TensorArray, eager and in a tf.function ------------------------------------------------

def tensor_array(e):
    ta = tf.TensorArray(F32, size=3)
    ta = ta.write(0, e).write(1, tf.sin(e)).write(2, e * 3.)
    back = tf.TensorArray(F32, size=4).unstack(e)
    # (Reads last: an eager TensorArray clears what it read, a graph one does not.)
    return ta.stack(), ta.concat(), ta.size(), back.read(2) + back.read(0), ta.read(1)


def tensor_array_loop(e):
    ta = tf.TensorArray(F32, size=3, element_shape=[4])
    _, ta = tf.while_loop(lambda i, ta: i < 3,
                          lambda i, ta: (i + 1, ta.write(i, e * tf.cast(i + 1, F32))), (0, ta))
    return ta.stack()


def tensor_array_gather(e):
    ta = tf.TensorArray(F32, size=3).unstack(tf.stack([e, e + 1., e * 2.]))
    return ta.gather([2, 0])


def map_fn_inside(e):
    return tf.map_fn(lambda r: r * r + 1., e)


def scan_inside(e):
    return tf.scan(lambda acc, r: acc * 0.5 + r, e)


@pytest.mark.parametrize("staged", [False, True], ids=["eager", "tf_function"])
@pytest.mark.parametrize("fn", [tensor_array, tensor_array_loop, map_fn_inside, scan_inside],
                         ids=lambda f: f.__name__)
def test_tensor_arrays_match_tf_vectorized_map(fn, staged, no_loop_fallback):
    if staged:
        inner = tf.function(fn)
        fn = lambda e: inner(e)  # noqa: E731 (a tf.function called from the map)
    check(fn)


@tf.function
def per_example_trip_count_with_tensor_array(e):
    ta = tf.TensorArray(F32, size=4, element_shape=[4])
    _, y, ta = tf.while_loop(lambda i, y, ta: tf.reduce_sum(y) < 20., lambda i, y, ta: (
        i + 1, y * 2., ta.write(i, y)), (0, e + 1., ta))
    return y, ta.stack()


def test_a_per_example_trip_count_loop_over_a_tensor_array_in_a_called_function():
    # The While runs once per example on each example's own list (taken apart from the
    # batched one and put together again). tf.vectorized_map fails here (in pfor's
    # converted loop: "Trying to access element ... in a list with 0 elements").
    check_map_fn(lambda e: per_example_trip_count_with_tensor_array(e))


@pytest.mark.parametrize("staged", [False, True], ids=["eager", "tf_function"])
def test_tensor_array_gather_puts_the_batch_first(staged, no_loop_fallback):
    fn = tf.function(tensor_array_gather) if staged else tensor_array_gather
    got = oh.vectorized_map(lambda e: fn(e), XS)
    assert got.shape == [3, 2, 4]
    check_map_fn(lambda e: fn(e))


# -- gradients ---------------------------------------------------------------------------------

W = tf.Variable(tf.linspace(0.5, 2., 4))


def list_loss(e):
    ta = tf.TensorArray(F32, size=2)
    ta = ta.write(0, e * W).write(1, tf.sin(e))
    return tf.reduce_sum(ta.stack() ** 2) + tf.reduce_sum(ta.read(0))


def raw_list_loss(e):
    lst = R.TensorListFromTensor(tensor=tf.stack([e, e * W]), element_shape=SHAPE)
    lst = R.TensorListPushBack(input_handle=lst, tensor=tf.sin(e))
    return tf.reduce_sum(stack(lst) ** 2) + tf.reduce_sum(get(lst, 1))


def loop_list_loss(e):
    ta = tf.TensorArray(F32, size=3, element_shape=[4])
    _, ta = tf.while_loop(lambda i, ta: i < 3, lambda i, ta: (
        i + 1, ta.write(i, tf.sin(e * W * tf.cast(i + 1, F32)))), (0, ta))
    return tf.reduce_sum(ta.stack() ** 2)


def loop_accumulator_loss(e):
    # A loop's gradient keeps its iterations' values in TensorList accumulators.
    _, y = tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, tf.sin(y) * e * W), (0, e))
    return tf.reduce_sum(y)


LOSSES = {"tensor_array": list_loss, "tensor_array_tf_function": tf.function(list_loss),
          "raw": raw_list_loss, "while_tensor_array_tf_function": tf.function(loop_list_loss),
          "while_accumulators_tf_function": tf.function(loop_accumulator_loss)}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_per_example_gradients_through_lists_match_map_fn(name, no_loop_fallback):
    loss = LOSSES[name]

    def per_example(tape_type):
        def fn(e):
            with tape_type() as tape:
                tape.watch(e)
                y = loss(e)
            return tape.gradient(y, [e, W])
        return fn

    want = tf.map_fn(per_example(tf.GradientTape), XS, fn_output_signature=[F32, F32])
    assert_same_tensors(want, oh.vectorized_map(per_example(oh.GradientTape), XS))


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_gradients_through_the_map_match_tf_vectorized_map(name, no_loop_fallback):
    loss = LOSSES[name]

    def run(vmap, tape_type):
        with tape_type() as tape:
            tape.watch(XS)
            y = tf.reduce_sum(vmap(loss, XS) ** 2)
        return tape.gradient(y, [XS, W])

    assert_same_tensors(run(tf.vectorized_map, tf.GradientTape),
                        run(oh.vectorized_map, oh.GradientTape))


# -- lists whose length is the example's trip count; dynamic_size TensorArrays -----------------
#
# tf.vectorized_map fails on all of these (InvalidArgumentError in pfor's converted loop:
# "Trying to access element ... in a list with 0 elements", or its TensorListSetItem
# written without the resize a dynamic_size TensorArray asks for); tf.map_fn is the
# reference. Inside a traced function oh.vectorized_map is tf.vectorized_map, which fails
# there as TensorFlow's does.

YS = tf.constant([-1.5, 2., -3., 0.5, 4.])


def _doubling_loop(x, ta):
    # per-example trip count: 2 to 5 iterations for YS
    return tf.while_loop(lambda i, y, ta: tf.abs(y) < 10.,
                         lambda i, y, ta: (i + 1, y * 2., ta.write(i, y * x)), (0, x, ta))[2]


@tf.function
def grown_per_example(x):
    ta = _doubling_loop(x, tf.TensorArray(F32, size=0, dynamic_size=True))
    return ta.size(), ta.read(0), ta.read(1)


@tf.function
def pushed_per_example(x):
    lst = R.EmptyTensorList(element_shape=tf.constant([], tf.int32), max_num_elements=-1,
                            element_dtype=F32)
    _, _, lst = tf.while_loop(lambda i, y, lst: tf.abs(y) < 10., lambda i, y, lst: (
        i + 1, y * 2., R.TensorListPushBack(input_handle=lst, tensor=y)), (0, x, lst))
    scalar = tf.constant([], tf.int32)
    return (R.TensorListLength(input_handle=lst),
            R.TensorListGetItem(input_handle=lst, index=1, element_shape=scalar,
                                element_dtype=F32))


@tf.function
def grown_uniformly(x):
    ta = tf.TensorArray(F32, size=0, dynamic_size=True)
    _, ta = tf.while_loop(lambda i, ta: i < 3, lambda i, ta: (
        i + 1, ta.write(i, tf.sin(x * tf.cast(i + 1, F32)))), (0, ta))
    return ta.stack()


@pytest.mark.parametrize("fn", [grown_per_example, pushed_per_example, grown_uniformly],
                         ids=lambda f: f.__name__)
def test_lists_of_per_example_lengths_and_growing_tensor_arrays_match_map_fn(fn):
    check_map_fn(lambda x: fn(x), YS)
    with pytest.raises(tf.errors.InvalidArgumentError):
        tf.vectorized_map(lambda x: fn(x), YS)
    with pytest.raises(tf.errors.InvalidArgumentError):  # traced: tf.vectorized_map's
        tf.function(lambda xs: oh.vectorized_map(lambda x: fn(x), xs))(YS)


def test_a_growing_tensor_array_is_vectorized(no_loop_fallback):
    check_map_fn(lambda x: grown_uniformly(x), YS)


@pytest.mark.parametrize("fn", [grown_per_example, pushed_per_example, grown_uniformly],
                         ids=lambda f: f.__name__)
def test_gradients_through_lists_of_per_example_lengths_match_map_fn(fn):
    def loss(x):
        return tf.reduce_sum([tf.reduce_sum(tf.cast(t, F32)) for t in fn(x)])

    def around(vmap, tape_type):
        with tape_type() as tape:
            tape.watch(YS)
            y = tf.reduce_sum(vmap(loss, YS) ** 2)
        return tape.gradient(y, YS)

    assert_same_tensors(around(tf.map_fn, tf.GradientTape),
                        around(oh.vectorized_map, oh.GradientTape))

    def inside(tape_type):  # per-example gradients (TensorListResize in a growing write's)
        def grad(x):
            with tape_type() as tape:
                tape.watch(x)
                y = loss(x) ** 2
            return tape.gradient(y, x)
        return grad

    assert_same_tensors(tf.map_fn(inside(tf.GradientTape), YS),
                        oh.vectorized_map(inside(oh.GradientTape), YS))


def test_stacking_lists_of_per_example_lengths_raises_naming_the_op():
    @tf.function
    def fn(x):
        return _doubling_loop(x, tf.TensorArray(F32, size=0, dynamic_size=True)).stack()

    with pytest.raises(ValueError):  # tf.map_fn: "Incompatible shape for value"
        tf.map_fn(fn, YS)
    with pytest.raises(tf.errors.InvalidArgumentError, match="oh.vectorized_map: op "
                       "TensorListStack gives outputs of different shapes"):
        oh.vectorized_map(lambda x: fn(x), YS)


def test_an_eager_tensor_array_in_a_per_example_loop_raises_naming_the_handler_and_op():
    def fn(x):
        return _doubling_loop(x, tf.TensorArray(F32, size=0, dynamic_size=True)).size()

    tf.map_fn(fn, YS, fn_output_signature=tf.int32)  # (runs there)
    with pytest.raises(oh.CopyOffError,
                       match=r"tf.while_loop \(While\) under VectorizedMap.*eager "
                             "tf.TensorArray"):
        oh.vectorized_map(fn, YS)


# -- TensorArrays through a per-example tf.cond --------------------------------------------

@tf.function
def _cond_written_tensor_array(x):
    # A stateless cond: oh.vectorized_map runs both branches and selects their lists.
    ta = tf.TensorArray(F32, size=1)
    ta = tf.cond(x > 0, lambda: ta.write(0, x * 3.), lambda: ta.write(0, tf.sin(x)))
    return tf.reduce_sum(ta.stack() ** 2)


def test_a_tensor_array_returned_by_a_per_example_cond_keeps_its_gradients(no_loop_fallback):
    xs = tf.constant([-1.5, 2., 3.])
    assert_same_tensors(tf.map_fn(_cond_written_tensor_array, xs),
                        oh.vectorized_map(_cond_written_tensor_array, xs))

    def around(vmap, tape_type):
        with tape_type() as tape:
            tape.watch(xs)
            y = tf.reduce_sum(vmap(_cond_written_tensor_array, xs))
        return tape.gradient(y, xs)

    want = around(tf.map_fn, tf.GradientTape)
    assert_same_tensors(want, around(oh.vectorized_map, oh.GradientTape))
    assert np.all(want.numpy() != 0)  # (values written in both branches have gradients)

    def inside(tape_type):
        def grad(x):
            with tape_type() as tape:
                tape.watch(x)
                y = _cond_written_tensor_array(x)
            return tape.gradient(y, x)
        return grad

    assert_same_tensors(tf.map_fn(inside(tf.GradientTape), xs),
                        oh.vectorized_map(inside(oh.GradientTape), xs))


V = tf.Variable(2.)


@tf.function
def _cond_writing_a_variable(x):
    # The cond reads a variable (a stateful If: it runs once per example) and gets a
    # reserved list none of whose elements is written yet, their shape unknown.
    ta = tf.TensorArray(F32, size=1)
    ta = tf.cond(x > 0, lambda: ta.write(0, V * x), lambda: ta.write(0, V + x))
    return ta.read(0)


def test_a_per_example_cond_writes_into_an_unwritten_tensor_array():
    xs = tf.constant([1., 2., 3.])

    def per_example(tape_type):
        def grad(x):
            with tape_type() as tape:
                y = _cond_writing_a_variable(x)
            return [y, tape.gradient(y, V)]
        return grad

    want = tf.map_fn(per_example(tf.GradientTape), xs, fn_output_signature=[F32, F32])
    assert_same_tensors(want[1], tf.constant([1., 2., 3.]))
    assert_same_tensors(want, oh.vectorized_map(per_example(oh.GradientTape), xs))
