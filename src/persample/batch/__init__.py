"""Where the samples are in each tensor of a forward, decided once, by data flow.

:mod:`~persample.batch.layouts` describes a tensor's layout and brings its samples
to the front; :mod:`~persample.batch.flow` propagates layouts through every op.
"""

from . import (  # noqa: F401  (the handler families: importing one registers its handlers)
    ops_elementwise,
    ops_indexing,
    ops_layers,
    ops_products,
    ops_views,
)
from .flow import Ctx, Flow, broadcasts, in_place, op_leaves, propagate
from .input_layouts import located, located_of
from .layouts import (
    SHARED,
    Batched,
    Layout,
    Mixed,
    Shared,
    Unknown,
    front,
    front_cotangents,
    is_batched,
)

__all__ = ["Ctx", "Flow", "broadcasts", "in_place", "op_leaves", "propagate", "located",
           "located_of", "SHARED",
           "Batched", "Shared", "Layout", "Mixed", "Unknown", "front", "front_cotangents",
           "is_batched"]
