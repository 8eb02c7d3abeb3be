"""Record one forward pass: where the samples are in every tensor, and every op that
reads a trainable parameter.

- :mod:`~persample.capture.recorder`: the :class:`Capture` context manager (the
  hooks, each op run and recorded, derived tensors);
- :mod:`~persample.capture.mode`: the ``TorchFunctionMode`` that sees every op, and
  hiding it from TorchDynamo;
- :mod:`~persample.capture.records`: what is kept of each module call and op;
- :mod:`~persample.capture.edges`: where each recorded output's gradient is read;
- :mod:`~persample.capture.tensors`: the tensors a model holds and a call carries.

Layouts are decided by :mod:`persample.batch` only; what a capture changes outside
itself while open (checkpoints, torch.compile's stance) is :mod:`persample.patches`.
"""

from .edges import Edge, edge_of
from .recorder import Capture
from .records import Call, Derived, Op
from .tensors import user_leaf

__all__ = ["Capture", "Call", "Op", "Derived", "Edge", "edge_of", "user_leaf"]
