"""The Op object: type, attrs, outputs, creation, and keeping an Op past its callback."""
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from conftest import assert_close


class Keeper(oh.OpHandler):
    def __init__(self):
        self.ops = []

    def execute(self, op, inputs):
        self.ops.append(op)
        return self.next.execute(op, inputs)


def test_op_fields_and_attrs(x):
    k = Keeper()
    with k:
        tf.matmul(x, x, transpose_b=True)
        tf.cast(x, tf.int32)
        tf.unique(tf.constant([3, 1, 3]))
    matmul, cast, unique = k.ops
    assert matmul.type == "MatMul" and matmul.num_outputs == 1
    assert matmul.attrs["transpose_b"] is True and matmul.attrs["transpose_a"] is False
    assert matmul.attrs["T"] == tf.float32
    assert cast.attrs["DstT"] == tf.int32 and cast.output_dtypes == [tf.int32]
    assert unique.num_outputs == 2 and unique.output_dtypes == [tf.int32, tf.int32]
    assert matmul.requested_device == oh.DISPATCHER_DEVICE
    assert "MatMul" in repr(matmul)


def test_kept_op_detaches_and_can_be_replayed(x):
    k = Keeper()
    with k:
        tf.matmul(x, x, transpose_a=True)
    (op,) = k.ops
    assert not op._borrowed  # the borrow ended when the callback returned
    (again,) = oh.PHYSICAL.execute(op, [x, x])
    assert_close(again, tf.matmul(x, x, transpose_a=True))


def test_create_and_replace():
    op = oh.Op.create("AddV2", T=tf.float32)
    (y,) = oh.PHYSICAL.execute(op, [tf.constant(1.0), tf.constant(2.0)])
    assert float(y) == 3.0
    mm = oh.Op.create("MatMul", T=tf.float32, transpose_a=False, transpose_b=False)
    mm_t = mm.replace(transpose_b=True)
    a = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    (r,) = oh.PHYSICAL.execute(mm_t, [a, a])
    assert_close(r, tf.matmul(a, a, transpose_b=True))
    with pytest.raises(TypeError, match="no attr"):
        oh.Op.create("AddV2", T=tf.float32, bogus=1)
    with pytest.raises(ValueError):
        oh.Op.create("NoSuchOpAnywhere")


def test_physical_execute_of_a_bad_op_raises_tf_error():
    op = oh.Op.create("MatMul", T=tf.float32, transpose_a=False, transpose_b=False)
    with pytest.raises(tf.errors.InvalidArgumentError):
        oh.PHYSICAL.execute(op, [tf.ones([2, 3]), tf.ones([2, 3])])


def test_handler_can_rewrite_an_op(x):
    class FlipTranspose(oh.OpHandler):
        def execute(self, op, inputs):
            if op.type == "MatMul":
                op = op.replace(transpose_b=not op.attrs["transpose_b"])
            return self.next.execute(op, inputs)

    with FlipTranspose():
        y = tf.matmul(x, x)
    assert_close(y, np.matmul(x.numpy(), x.numpy().T))


def test_guide_autocast_handler_runs_matmul_in_bfloat16():
    class Autocast(oh.OpHandler):
        def __init__(self):
            self.cast = 0

        def execute(self, op, inputs):
            if op.type == "MatMul" and op.attrs["T"] == tf.float32:
                self.cast += 1
                low = [tf.cast(t, tf.bfloat16) for t in inputs]
                (out,) = self.next.execute(op.replace(T=tf.bfloat16), low)
                return [tf.cast(out, tf.float32)]
            return self.next.execute(op, inputs)

    a = tf.random.stateless_normal([8, 8], seed=[0, 0])
    h = Autocast()
    with h:
        y = tf.matmul(a, a)
    low = tf.cast(tf.matmul(tf.cast(a, tf.bfloat16), tf.cast(a, tf.bfloat16)), tf.float32)
    assert y.dtype == tf.float32 and h.cast == 1
    assert_close(y, low)
    assert not np.allclose(y.numpy(), tf.matmul(a, a).numpy(), atol=1e-6)


def test_replace_keeps_empty_list_attrs():
    # Conv2D has explicit_paddings=[]: an empty list must stay a list attr.
    x, k = tf.ones([1, 4, 4, 1]), tf.ones([2, 2, 1, 1])

    class Replace(oh.OpHandler):
        def execute(self, op, inputs):
            if op.type == "Conv2D":
                op = op.replace(use_cudnn_on_gpu=True)
            return self.next.execute(op, inputs)

    with Replace():
        y = tf.nn.conv2d(x, k, 1, "VALID")
    assert_close(y, tf.nn.conv2d(x, k, 1, "VALID"))


def test_attribute_caches_key_by_content_not_byte_order():
    """TensorFlow serializes one attribute set in many byte orders (its map's hash order
    differs per op): attrs_key is equal for equal attributes and differs for different
    ones, and attrs decodes each content once."""
    from tensorflow.core.framework import attr_value_pb2
    from tf_ophandlers.core import op as op_module
    x = tf.random.stateless_normal([1, 5, 5, 2], seed=[1, 1])
    w = tf.random.stateless_normal([1, 1, 2, 2], seed=[2, 2])
    k = Keeper()
    with k:
        for stride in (1, 1, 1, 2):
            for _ in range(30):
                tf.nn.conv2d(x, w, stride, "SAME")
    raws = {}
    for op in k.ops:  # kept ops: their own attribute copies
        raws.setdefault(op.attrs["strides"][1], set()).add(op._attrs_proto())
        assert op.attrs is k.ops[0].attrs or op.attrs["strides"][1] == 2
    for stride, keys in ((s, {op.attrs_key() for op in k.ops if op.attrs["strides"][1] == s})
                         for s in (1, 2)):
        assert len(keys) == 1, stride
        assert {op_module._canonical(r) for r in raws[stride]} == keys
    assert {op.attrs_key() for op in k.ops[:30]} != {op.attrs_key() for op in k.ops[-30:]}
    for raw in raws[1] | raws[2]:  # the canonical form is the same content, fields sorted
        assert attr_value_pb2.NameAttrList.FromString(op_module._canonical(raw)) == \
            attr_value_pb2.NameAttrList.FromString(raw)
    # An unexpected encoding (a varint field) takes the slow way, with the same content.
    odd = attr_value_pb2.NameAttrList(name="X")
    odd.attr["a"].i = 1
    raw = odd.SerializeToString() + b"\x18\x01"
    again = attr_value_pb2.NameAttrList.FromString(op_module._canonical(raw))
    assert again.name == "X" and again.attr["a"].i == 1


def test_attrs_proto_is_one_byte_string_per_content():
    """cc/boundary/op.cc sorts the serialized attributes' top-level fields, so the same attributes
    give the same bytes on every op (TensorFlow's own order varies with its hash map):
    raw-keyed caches hit, and the bytes equal core/op.py's canonical form."""
    from tf_ophandlers.core import op as op_module
    by_type = {}

    class Raw(oh.OpHandler):
        def execute(self, op, inputs):
            by_type.setdefault(op.type, set()).add(op._attrs_proto())
            return self.next.execute(op, inputs)

    x = tf.random.stateless_normal([1, 5, 5, 2], seed=[1, 1])
    w = tf.random.stateless_normal([1, 1, 2, 2], seed=[2, 2])
    a = tf.ones([3, 3])
    with Raw():
        for _ in range(100):
            tf.nn.conv2d(x, w, 1, "SAME")
            tf.matmul(a, a, transpose_b=True)
    assert {t: len(by_type[t]) for t in ("Conv2D", "MatMul")} == {"Conv2D": 1, "MatMul": 1}
    for t in ("Conv2D", "MatMul"):
        raw = next(iter(by_type[t]))
        assert op_module._canonical(raw) == raw
