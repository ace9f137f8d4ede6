"""A second level of checkpointing inside a segment's gradient function.

A segment's gradient function recomputes the segment's nodes and differentiates them in
one graph. The values the backward pass of the segment's first nodes reads (a ResNet
bottleneck's narrow convolutions, their batch norms and activations) are then alive
while the backward pass of its last nodes runs, with that part's own working values
(the block's wide activations and their gradients): in a ResNet50 step that working set
is where the step peaks, with every weight gradient alive.

When the segment narrows somewhere inside, the gradient function splits at the narrowest
place (`cut`: the values the nodes after it read from the nodes before it, the
*frontier*, take the fewest bytes) and runs in three phases, as checkpointing does for
a whole network:

1. the nodes before the cut (the *prefix*) run once, and only the frontier stays alive;
2. the nodes after it (the *suffix*) are recomputed from the frontier and the inputs and
   differentiated down to the frontier (`stop_gradients`: not through the prefix);
3. after that (control edges), the prefix runs again and is differentiated, its output
   gradients the frontier's.

The prefix runs twice (more computation); the working values of the two parts are never
alive together. An input's gradient is the sum of both phases' parts, as TensorFlow's
gradient sums a value's uses.
"""
import tensorflow as tf

from tf_ophandlers.handlers.recompute.thinning import nbytes

# A split needs its frontier to be at most this share of the largest value the segment
# computes (a narrow place), and each part at least this share of the segment's bytes
# (a cut near either end saves little, and the prefix is computed twice).
_NARROW = 0.5
_BALANCE = 0.25


def cut(nodes, results, output_refs):
    """The node index where the prefix ends (the suffix starts), or None: the position
    whose frontier takes the fewest bytes among those narrow and balanced enough, ties
    broken by the larger smaller part. `results` are the nodes' replayed outputs (their
    static shapes give the sizes); `output_refs` the differentiated outputs."""
    n = len(nodes)
    if n < 4:
        return None
    if any(t.shape.num_elements() is None for outs in results for t in outs):
        return None  # (unknown sizes: nothing to plan on)
    sizes = [[nbytes(t) for t in outs] for outs in results]
    computed = [sum(s) for s in sizes]
    total = sum(computed)
    largest = max((b for s in sizes for b in s), default=0)
    if total <= 0 or largest <= 0:
        return None
    last_use = {}  # (node, output) -> last node reading it
    for j, node in enumerate(nodes):
        for p, i in node[1]:
            if p >= 0:
                last_use[(p, i)] = j
    outputs = set(output_refs)
    best, prefix = None, 0
    crossing = {}  # values of nodes < p read by a node >= p, with their bytes
    for p in range(1, n):
        prefix += computed[p - 1]
        for k, b in enumerate(sizes[p - 1]):
            if last_use.get((p - 1, k), -1) >= p:
                crossing[(p - 1, k)] = b
        for nk in [nk for nk in crossing if last_use[nk] < p]:
            del crossing[nk]
        if not crossing or any(nk in outputs for nk in crossing):
            continue  # (independent parts, or an output read after the cut)
        frontier = sum(crossing.values())
        smaller = min(prefix, total - prefix)
        if frontier > _NARROW * largest or smaller < _BALANCE * total:
            continue
        if not any(nk[0] >= p for nk in output_refs):
            continue  # (nothing after the cut is differentiated)
        key = (frontier, -smaller)
        if best is None or key < best[0]:
            best = (key, p)
    return None if best is None else best[1]


def frontier(nodes, p):
    """The values of nodes before `p` that nodes from `p` on read (sorted refs)."""
    return sorted({(q, i) for node in nodes[p:] for q, i in node[1] if 0 <= q < p})


def aggregate(parts):
    """The sum of gradient parts (None parts left out; None if none is left), as
    TensorFlow's tape aggregates them: IndexedSlices parts only stay IndexedSlices
    (concatenated), anything else is summed dense. (Also segments.py's.)"""
    parts = [g for g in parts if g is not None]
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(g, tf.IndexedSlices) for g in parts):
        return tf.IndexedSlices(tf.concat([g.values for g in parts], 0),
                                tf.concat([g.indices for g in parts], 0),
                                parts[0].dense_shape)
    return tf.add_n([tf.convert_to_tensor(g) for g in parts])


def gradients(graph, nodes, ext, results, p, output_refs, gs, xs, replay):
    """The gradients of `xs` (tensors of `ext`) given the gradients `gs` of the outputs
    `output_refs`, in the three phases of the module docstring; `results` are the nodes
    replayed once (phases 1 and 2 use them: the executor frees the prefix's values once
    the frontier is computed), `replay(graph, nodes, ext)` replays nodes again (phase 3)."""
    front = frontier(nodes, p)
    front_tensors = [results[q][i] for q, i in front]
    late = [(r, g) for r, g in zip(output_refs, gs) if r[0] >= p]
    early = [(r, g) for r, g in zip(output_refs, gs) if r[0] < p]
    # Phase 2: the suffix's backward, down to the frontier and the inputs it reads.
    grads = tf.gradients([results[q][i] for (q, i), _ in late], front_tensors + list(xs),
                         grad_ys=[g for _, g in late], stop_gradients=front_tensors)
    d_front, late_xs = grads[:len(front)], grads[len(front):]
    # Phase 3: the prefix again, after phase 2's frontier gradients exist.
    seeds = {}
    for (q, i), g in zip(front, d_front):
        if g is not None:
            seeds.setdefault((q, i), []).append(
                tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g)
    for r, g in early:
        seeds.setdefault(r, []).append(g)
    if not seeds:
        return late_xs
    gates = [g.op for g in d_front if g is not None and not isinstance(g, tf.IndexedSlices)]
    start = len(graph.get_operations())
    again = replay(graph, nodes[:p], ext)
    created = graph.get_operations()[start:]
    mine = set(created)
    for op in created:
        if gates and not any(t.op in mine for t in op.inputs):
            for gate in gates:
                op._add_control_input(gate)  # pylint: disable=protected-access
    refs = sorted(seeds)
    early_xs = tf.gradients([again[q][i] for q, i in refs], list(xs),
                            grad_ys=[aggregate(seeds[r]) for r in refs])
    return [aggregate([a, b]) for a, b in zip(late_xs, early_xs)]
