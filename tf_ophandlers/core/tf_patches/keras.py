"""Patches of Keras 3's TensorFlow backend (imported only when one installs; without
Keras they install nothing). Each is one symbol; subscribers innermost first."""
from tf_ophandlers.core.tf_patches.registry import Symbol, declare

_TRAINER = "keras.src.backend.tensorflow.trainer"
_FIT = [("keras data-parallel fit", "the only subscriber")]
_NO_HOOK = ("Keras splits fit's batches, scales the loss by the replica count and "
            "all-reduces the gradients only for a tf.distribute strategy, with no hook for "
            "a replica group that is not a strategy")

declare(
    "TensorFlowTrainer.make_train_function",
    [Symbol(_TRAINER, "TensorFlowTrainer.make_train_function")], _NO_HOOK, _FIT,
    optional_module=_TRAINER)

declare(
    "trainer.tf", [Symbol(_TRAINER, "tf")],
    "Keras's eager train_step records on a tf.GradientTape, whose C++ tape cannot hold a "
    "tensor whose components differ in length (a batch split unevenly); Keras has no hook "
    "to choose the tape", _FIT, optional_module=_TRAINER)

for _name in ("scale_loss_for_distribution", "unscale_loss_for_distribution"):
    declare("loss." + _name, [Symbol("keras.src.losses.loss", _name)], _NO_HOOK, _FIT,
            optional_module="keras.src.losses.loss")

declare(
    "TFOptimizer._all_reduce_sum_gradients",
    [Symbol("keras.src.backend.tensorflow.optimizer", "TFOptimizer._all_reduce_sum_gradients")],
    _NO_HOOK, _FIT, optional_module="keras.src.backend.tensorflow.optimizer")

declare(
    "BaseOptimizer.apply",
    [Symbol("keras.src.optimizers.base_optimizer", "BaseOptimizer.apply")],
    "a host variable among an optimizer step's writes fails only at its own write, after "
    "the weights changed (a retry would apply the step twice); Keras has no hook before a "
    "step's first write",
    [("keras optimizer step check", "the only subscriber")],
    optional_module="keras.src.optimizers.base_optimizer")
