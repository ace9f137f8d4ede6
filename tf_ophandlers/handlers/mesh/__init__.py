"""`oh.Mesh`: Mesh-TensorFlow/DTensor-style sharding as an op handler.

handler.py the handler; rules.py and rules_nn.py the SPMD rules; variables.py variable
ops; comm.py per-device launches and communication; compiled.py compiled per-op calls;
checkpoint.py per-shard checkpoints."""
from tf_ophandlers.handlers.mesh.handler import RULES, Mesh

__all__ = ["Mesh", "RULES"]
