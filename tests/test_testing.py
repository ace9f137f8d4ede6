"""oh.testing: our handlers pass the conformance kit, and broken handlers fail it."""
import tempfile

import pytest
import tensorflow as tf

import tf_ophandlers as oh

_X = tf.constant([1., 2.])
_DUMP_ROOT = tempfile.mkdtemp(prefix="oh-conformance-dump-")
HANDLERS = {
    "pass_through": (oh.OpHandler, {}),
    "op_log": (oh.OpLogHandler, {}),
    "check_numerics": (oh.CheckNumericsHandler, {}),
    "gradient_tape": (oh.GradientTape, {}),
    "forward_accumulator": (lambda: oh.ForwardAccumulator(_X, _X), {}),
    "parallel": (lambda: oh.ParallelHandler(["CPU:0", "CPU:1"]), {"copy_off": False}),
    "trace_and_execute": (oh.TraceAndExecute, {}),
    "lazy": (oh.Lazy, {}),
    "async": (oh.Async, {}),
    "recompute": (oh.Recompute, {}),
    "debugger": (lambda: oh.DebuggerHandler(_DUMP_ROOT, tensor_debug_mode="FULL_HEALTH"), {}),
}


@pytest.mark.parametrize("name", sorted(HANDLERS))
def test_shipped_handlers_conform(name):
    make, options = HANDLERS[name]
    report = oh.testing.check_handler(make, **options)
    assert report.failures == []
    assert len(report.checks) >= 14


class _Doubles(oh.OpHandler):
    def execute(self, op, inputs):
        outs = self.next.execute(op, inputs)
        return [o * 2. if o.dtype.is_floating else o for o in outs]


class _NonLinearCopy(oh.OpHandler):
    def copy_on(self, tensor):
        value = super().copy_on(tensor)
        return value * value if value.dtype.is_floating else value


_REGISTRY = []


class _Leaks(oh.OpHandler):
    def __init__(self):
        _REGISTRY.append(self)


class _BadCopyOff(oh.OpHandler):
    def copy_off(self, value, device):
        return value + 1. if value.dtype.is_floating else value


@pytest.mark.parametrize("handler,check", [
    (_Doubles, "program elementwise"),
    (_NonLinearCopy, "CopyOn is linear"),
    (_Leaks, "lifetime ends"),
    (_BadCopyOff, "copies round-trip"),
], ids=["wrong_values", "non_linear_copy_on", "leak", "bad_copy_off"])
def test_broken_handlers_fail_the_named_check(handler, check):
    report = oh.testing.check_handler(handler)
    assert any(f.startswith(check) for f in report.failures), report.failures
    with pytest.raises(oh.testing.ConformanceError, match=check):
        oh.testing.check_handler(handler, programs=["elementwise"], raise_on_failure=True)
