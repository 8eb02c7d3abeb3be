"""Per-module fallback: per-sample gradients of one module through ``torch.func``.

DESIGN.md point 3: a module without a rule is differentiated alone, not the
whole model. For one captured call with inputs ``x`` and backprops ``g``, the
per-sample gradient of the module's parameters is the vector-Jacobian product
``vjp(theta -> module(x[i:i+1]; theta))(g[i:i+1])``, batched over ``i`` with
``torch.func.vmap`` (the method of seed 001's tutorial, applied to one module).

Inputs are mapped over their batch dim (``layout.py``: dim 0 if its size is the
batch size; the stock sequence modules' own layouts); all others are shared.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from .capture import Call, flat_outputs
from .layout import input_layouts, output_layouts


class UnsupportedModuleError(RuntimeError):
    """A module has no rule and ``torch.func`` cannot differentiate it per sample."""


def fallback_grads(
    call: Call, params: dict[str, nn.Parameter], backprops: list[Tensor], n: int
) -> dict[str, Tensor]:
    """Per-sample vector-Jacobian products ``{name: (n, v, *param.shape)}`` for one call.

    ``params`` maps names relative to ``call.module`` (``"scale"``,
    ``"out_proj.weight"``) to parameters; ``backprops`` are the ``(n, v, *out)``
    cotangents of the call's differentiable outputs, in order.
    """
    leaves, spec = tree_flatten((call.args, call.kwargs))
    layouts = input_layouts(call, n)
    mapped = [lay.front(x.detach()) for x, lay in zip(leaves, layouts) if lay is not None]
    used = [i for i, o in enumerate(flat_outputs(call.output)) if o.requires_grad]
    out_layouts = output_layouts(call, n)
    theta = {name: p.detach() for name, p in params.items()}

    def one_sample(mapped_i: list[Tensor], cotangents_i: list[Tensor]) -> dict[str, Tensor]:
        rows = iter(mapped_i)
        values = [
            lay.insert(next(rows)) if lay is not None
            else (x.detach() if isinstance(x, Tensor) else x)
            for x, lay in zip(leaves, layouts)
        ]
        args, kwargs = tree_unflatten(values, spec)

        def forward(th: dict[str, Tensor]) -> tuple[Tensor, ...]:
            out = flat_outputs(functional_call(call.module, th, tuple(args), kwargs))
            return tuple(out[i] for i in used)

        def pull(*c: Tensor) -> dict[str, Tensor]:
            return pullback(tuple(lay.insert(ci) for ci, lay in zip(c, out_layouts)))[0]

        _, pullback = vjp(forward, theta)
        return vmap(pull)(*cotangents_i)  # (v, *out) cotangents -> (v, *param.shape)

    try:
        return vmap(one_sample)(mapped, list(backprops))
    except Exception as err:  # torch.func raises many kinds of errors
        raise UnsupportedModuleError(
            f"module '{call.name or '<root>'}' ({type(call.module).__name__}) has no per-sample "
            f"rule and torch.func could not differentiate it per sample: {err}. "
            "Register a rule for it (persample.register_rule), freeze or replace it, or, "
            "where the function has one, use method='loop'."
        ) from err
