"""`ForwardAccumulator` (handlers/forward_accumulator/handler.py): the MaxPool JVP rule, and what
nested accumulators need (distinct inputs for TensorFlow's construction run eagerly; the
zero tangents an accumulator below gets for the JVPs of one above).
"""
import tensorflow as tf

from tf_ophandlers.extend import call_records, current_stack, representation_of, state

_NHWC = (b"NHWC", "NHWC")


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


def max_pool(fallback):
    """MaxPool's JVP: the tangent at each window's maximum (MaxPoolWithArgmax, per image).

    TensorFlow's construction (MaxPoolGradGrad on the tangent) is right eagerly, but in a
    graph (a replayed tf.function, a JVP under oh.vectorized_map) MaxPoolGradGrad returns
    zeros when its input shape is its output shape (SAME, stride 1) and the tangent is an
    intermediate result: the kernel reuses that input's buffer for its output. The
    maximum is the first of a window in both (ties agree). `fallback` (TensorFlow's
    construction) for what MaxPoolWithArgmax lacks: NCHW, explicit padding."""
    def rule(execute, op, primals, tangents, outputs):
        attrs = op.attrs
        padding = _text(attrs.get("padding"))
        if (attrs.get("data_format", b"NHWC") not in _NHWC
                or padding not in ("SAME", "VALID") or tangents[0] is None):
            return fallback(execute, op, primals, tangents, outputs)
        (x,), (t,) = primals, tangents
        _, argmax = tf.raw_ops.MaxPoolWithArgmax(  # (no JVP of its own: an integer)
            input=tf.stop_gradient(x), ksize=list(attrs["ksize"]), strides=list(attrs["strides"]),
            padding=padding, include_batch_in_index=False)
        # Indices within each image (so that vectorized_map can fold its batch in).
        n = tf.shape(x, out_type=tf.int64)[0]
        per_image = tf.size(x, out_type=tf.int64) // tf.maximum(n, 1)
        offsets = tf.reshape(tf.range(n) * per_image, [-1, 1, 1, 1])
        return [tf.gather(tf.reshape(t, [-1]), argmax + offsets)]
    return rule


def under_another(accumulator, kind):
    """Whether a call reaching `accumulator` is another recording accumulator's (`kind`)
    replay of a tf.function (its JVPs inside), kept whole by a handler between (e.g.
    oh.Recompute). TensorFlow computes nested accumulators' JVPs of a call op by op in
    one function, where an argument without a tangent has none (None, not the zeros of
    a call's JVP)."""
    return any(isinstance(s.handler, kind) and s.handler is not accumulator
               and s.handler._live  # pylint: disable=protected-access
               for run in call_records.replays_running() for s in run.segment)


def distinct(primals):
    """`primals` with each repeated input (tf.maximum(t, t)) copied: TensorFlow's JVP
    construction run eagerly watches the inputs on a tape, which knows a tensor by its
    id, so each occurrence would get the gradient of all of them (a tangent counted
    twice). A traced JVP function gets one placeholder per input instead."""
    seen, out = set(), []
    for p in primals:
        key = getattr(p, "_id", None)
        if key is not None and key in seen:
            p = tf.identity(p)
        seen.add(key)
        out.append(p)
    return out


def _dual(handler, tensor):
    """`handler`'s representation of `tensor` (a tensor of a stack above or at it), or
    None. A per-example value of an oh.vectorized_map between (which refuses to copy it
    off) is looked up as the map's batched tensor (`carrier`): whether it has a tangent,
    and where a zero one goes (one per example; an accumulator around the map:
    OH_FUZZ_SEED=90 slow case 32, None where tf.vectorized_map's trace gives zeros)."""
    found, value = representation_of(handler, tensor, carrier=True)
    return value if found else None


def _sources(primals, outputs, tangents, multilinear):
    """The tensors whose tangents in an accumulator below make it see a JVP as TensorFlow's
    accumulators do (see connect_below), or []."""
    if tf.executing_eagerly() and not _under_a_map():
        # Eagerly TensorFlow computes a JVP as one call of a traced function of the op's
        # inputs, outputs and tangents: an accumulator below that sees a tangent on any
        # of them gives every output of the call a tangent (zeros where the JVP does not
        # depend on it: a matmul by a constant). So do accumulators opened inside
        # tf.vectorized_map's traced function (OH_FUZZ_SEED=100 slow case 4).
        return list(primals) + list(outputs) + [t for t in tangents if t is not None]
    if multilinear:
        # In a function (and in tf.vectorized_map's, which traces the mapped function:
        # an oh.vectorized_map above the accumulator) TensorFlow's accumulators inline the JVP graph: the ones below see
        # its ops. A multilinear op's JVP there has a term op(..., zeros, ...) for each
        # float input without a tangent, which reads the other inputs (zeros below where
        # they have tangents). The other rules' ops match TensorFlow's JVP graphs
        # (reshapes, sums, casts, additions of the tangents: None below, as there).
        missing = [i for i, (p, t) in enumerate(zip(primals, tangents))
                   if t is None and (p.dtype.is_floating or p.dtype.is_complex)]
        return [p for j, p in enumerate(primals) if any(i != j for i in missing)]
    return []


def _under_a_map():
    """Whether the op came through an open scope above the running accumulator (one
    whose handler is not on the current stack, which ends at the accumulator) of a
    handler whose TensorFlow counterpart traces its ops (`counterpart_traces`:
    oh.vectorized_map, as tf.vectorized_map traces the mapped function)."""
    handlers = current_stack().handlers
    return any(getattr(e.target, "counterpart_traces", False)
               and not any(e.target is h for h in handlers) for e in state.scopes)


def connect_below(accumulator, types, primals, outputs, tangents, out_tangents,
                  multilinear=False):
    """`out_tangents` (the JVP of an op) given zero tangents in the accumulators below
    `accumulator` where TensorFlow's nested accumulators give zeros and the rules here
    (ops on the tangents only) would leave None. `types`: (ForwardAccumulator, Dual).
    Returns the (possibly replaced) tangents."""
    accumulator_type, dual_type = types
    below = [h for h in current_stack().handlers
             if isinstance(h, accumulator_type) and h is not accumulator]
    if not below:
        return out_tangents
    sources = _sources(primals, outputs, tangents, multilinear)
    out_tangents = list(out_tangents)
    inputs = {id(v) for v in list(primals) + list(outputs) + list(tangents)}
    for outer in below:
        if not any(getattr(_dual(outer, v), "tangent", None) is not None for v in sources):
            continue
        for i, t in enumerate(out_tangents):
            if t is None:
                continue
            dual = _dual(outer, t)
            if dual is None or id(t) in inputs:
                # A tensor of no stack (a watched tangent) or one of the op's: a new one,
                # so that the zero tangent is this JVP's only.
                t = out_tangents[i] = tf.identity(t)
                dual = _dual(outer, t)
            if isinstance(dual, dual_type) and dual.tangent is None:
                # (The op itself: tf.zeros_like of a static shape in a function being
                # replayed is a constant, on no stack.)
                zeros = _dual(outer, tf.raw_ops.ZerosLike(x=t))
                if zeros is not None:
                    dual.tangent = zeros.primal
    return out_tangents
