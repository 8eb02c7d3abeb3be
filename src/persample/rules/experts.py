"""Per-sample gradients of a mixture of experts as transformers ships it (Mixtral,
Qwen-MoE, OLMoE...): one module holding every expert's weights as 3-d tables,
``gate_up_proj (E, 2I, H)`` and ``down_proj (E, H, I)``, called with the tokens
``(R, H)`` (the batch's rows merged with its tokens), the experts each token chose
``(R, k)`` and their weights ``(R, k)``.

Whatever the implementation runs inside (the eager loop over the experts any token
chose; the default grouped one, sorting the tokens by expert for ``torch._grouped_mm``
with offsets counted by ``histc``), each token ``r`` routed to expert ``e`` with weight
``w`` computes ``y = w * W_d[e] (act(g) * u)``, ``[g; u] = W_gu[e] x_r``, and the output
row ``r`` is the sum of its ``k`` experts' ``y``. The rule recomputes that per expert on
the tokens routed to it and sums the outer products of each token's backprops and
inputs into its sample's row (Goodfellow 2015, as for a linear layer on sequences):

- ``grad W_d[n, e] = sum_{r of n routed to e} (w g_r) (act(g) * u)_r^T``
- ``grad W_gu[n, e] = sum_{r of n routed to e} [act'(g) (W_d^T w g_r) * u; act(g) *
  (W_d^T w g_r)] x_r^T``

Index conventions: ``n`` sample, ``v`` cotangent, ``m`` a token routed to the expert.
The module is recognised by its parameters and ``forward(hidden_states, top_k_index,
top_k_weights)`` (transformers is not imported); configurations with biases,
transposed or interleaved tables, no gate or a norm after each expert take the ops'
own paths. The router, outside this module, takes its linear rule: the gradients
through the routing weights reach it by the main backward.

Source: Shazeer et al. 2017 (sparsely-gated mixture of experts); Jiang et al. 2024
(Mixtral).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .spec import Decline, ModuleSpec, register_module

_FORWARD = ["hidden_states", "top_k_index", "top_k_weights"]


def is_experts(module: nn.Module) -> bool:
    """Does ``module`` look like transformers' experts module (see the module
    docstring)?"""
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gu, nn.Parameter) and isinstance(down, nn.Parameter)
            and gu.dim() == 3 and down.dim() == 3 and callable(getattr(module, "act_fn", None))):
        return False
    try:
        names = list(inspect.signature(type(module).forward).parameters)[1:4]
    except (TypeError, ValueError):
        return False
    return names == _FORWARD


def check(module: nn.Module) -> None:
    """Decline the configurations the rule does not compute."""
    flags = {"has_bias": False, "is_transposed": False, "has_post_expert_norm": False,
             "_is_expert_parallel": False}
    for name, want in flags.items():
        if bool(getattr(module, name, want)) != want:
            raise Decline(f"experts with {name}={getattr(module, name)}")
    if not getattr(module, "has_gate", True) or not getattr(module, "is_concatenated", True):
        raise Decline("experts without a concatenated gate")
    experts, inter2, hidden = module.gate_up_proj.shape
    if module.down_proj.shape != (experts, hidden, inter2 // 2) or inter2 % 2:
        raise Decline("expert tables of unexpected shapes")
    if any(p is not None and p.requires_grad for name, p in module.named_parameters()
           if name not in ("gate_up_proj", "down_proj")):
        raise Decline("experts with other trainable parameters")


def experts(layer: nn.Module, activations: tuple, backprops: Tensor, out: dict) -> None:
    """``out["gate_up_proj"] (n, v, E, 2I, H)``, ``out["down_proj"] (n, v, E, H, I)``."""
    hidden, index, weights = activations[:3]  # (n, T, H), (n, T, k), (n, T, k)
    n, v = backprops.shape[:2]
    rows = hidden.reshape(-1, hidden.shape[-1])  # (R, H), samples in order
    per = rows.shape[0] // n
    sample = torch.arange(n, device=rows.device).repeat_interleave(per)  # (R,)
    index, weights = index.reshape(rows.shape[0], -1), weights.reshape(rows.shape[0], -1)
    g = backprops.reshape(n, v, per, -1).transpose(0, 1).reshape(v, rows.shape[0], -1)
    gate_up, down = layer.gate_up_proj.detach(), layer.down_proj.detach()
    want_gu, want_d = out.get("gate_up_proj"), out.get("down_proj")
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(index == e)  # (m,), (m,)
        if not len(token):  # no token chose it: zeros
            for t in (want_gu, want_d):
                if t is not None:
                    t[:, :, e].zero_()
            continue
        x = rows[token].to(gate_up.dtype)  # (m, H)
        pre_up = F.linear(x, gate_up[e])  # (m, 2I)
        pre, up = pre_up.chunk(2, dim=-1)  # (m, I) each
        act, pull = _activation(layer.act_fn, pre)  # act(pre), and its pullback
        h = act * up  # (m, I)
        gy = g[:, token] * weights[token, slot].to(g.dtype)[None, :, None]  # (v, m, H)
        padded = _Padded(sample[token], n)  # each sample's tokens, in rows of its own
        if want_d is not None:
            want_d[:, :, e] = padded.outer_sums(gy, h)
        if want_gu is not None:
            dh = gy @ down[e]  # (v, m, I)
            dgu = pre_up.new_empty((v, *pre_up.shape))  # (v, m, 2I): [dpre, dup]
            pull(dh * up, dgu[..., :pre.shape[-1]])
            torch.mul(dh, act, out=dgu[..., pre.shape[-1]:])
            want_gu[:, :, e] = padded.outer_sums(dgu, x)


def _activation(fn: Callable[[Tensor], Tensor], pre: Tensor
                ) -> tuple[Tensor, Callable[[Tensor, Tensor], None]]:
    """``fn(pre)`` and its pullback ``pull(g, into)``, ``into = g * fn'(pre)`` entry by
    entry for ``g (v, m, I)``: for SiLU (Mixtral's) torch's own fused kernels, for
    another activation autograd's."""
    if isinstance(fn, nn.SiLU) or type(fn).__name__ == "SiLUActivation":
        def silu_pull(g: Tensor, into: Tensor) -> None:
            torch.ops.aten.silu_backward(g, pre, grad_input=into)

        return F.silu(pre), silu_pull
    leaf = pre.detach().requires_grad_()
    with torch.enable_grad():
        out = fn(leaf)

    def pull(g: Tensor, into: Tensor) -> None:
        into.copy_(torch.autograd.grad(out, leaf, g, is_grads_batched=True,
                                       retain_graph=True)[0])

    return out.detach(), pull


_GROUPED = (torch.float32, torch.bfloat16, torch.float16)  # torch._grouped_mm's, on the CPU


class _Padded:
    """Tokens ``(m,)`` of samples ``owner`` (in sample order), each sample's sum of
    outer products taken in one call: on the CPU in float32 or half precision by
    ``torch._grouped_mm`` over the samples' runs of tokens (the products split along
    the tokens by their offsets), otherwise as one batched matrix product of the tokens
    placed in a padded ``(n, M, ...)`` layout, ``M`` the most tokens of one sample."""

    def __init__(self, owner: Tensor, n: int):
        counts = torch.bincount(owner, minlength=n)  # (n,)
        self.ends = torch.cumsum(counts, 0)  # (n,) each sample's tokens end here
        starts = self.ends - counts
        self.owner, self.n = owner, n
        self.slot = torch.arange(len(owner), device=owner.device) - starts[owner]  # (m,)
        self._counts, self._most = counts, None

    def place(self, t: Tensor) -> Tensor:
        """``(..., m, d)`` -> ``(..., n, M, d)``, zeros where a sample has fewer."""
        if self._most is None:  # (read once: a synchronisation on a GPU)
            self._most = int(self._counts.max())
        out = t.new_zeros((*t.shape[:-2], self.n, self._most, t.shape[-1]))
        out[..., self.owner, self.slot, :] = t
        return out

    def outer_sums(self, g: Tensor, x: Tensor) -> Tensor:
        """``(n, v, o, i)``: per sample, ``sum_m g[v, m] x[m]^T`` for ``g (v, m, o)``,
        ``x (m, i)``."""
        v, m, o = g.shape
        if _groups(g, x):
            rows = g.transpose(0, 1).reshape(m, v * o)  # (m, v * o)
            sums = torch._grouped_mm(rows.t(), x.contiguous(), offs=self.ends.to(torch.int32))
            return sums.view(self.n, v, o, x.shape[-1])
        return (self.place(g).transpose(-1, -2) @ self.place(x)).transpose(0, 1)


def _groups(g: Tensor, x: Tensor) -> bool:
    """Can ``torch._grouped_mm`` take these: the CPU, float32 or half precision, rows of
    a multiple of 16 bytes?"""
    size = g.element_size()
    return (hasattr(torch, "_grouped_mm") and g.device.type == "cpu" and g.dtype in _GROUPED
            and x.dtype == g.dtype and (g.shape[0] * g.shape[2] * size) % 16 == 0
            and (x.shape[-1] * size) % 16 == 0)


EXPERTS = register_module(ModuleSpec((), grad=experts, check=check, match=is_experts,
                                     rows=True, keeps_layout=True))
