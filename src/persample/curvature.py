"""Curvature from the same records as the per-sample gradients: K-FAC factors of every
parameter whose ops give factors, and the exact diagonal of the others.

For a linear map at ``T`` positions, sample ``n``'s gradient is ``sum_t g_nt a_nt^T``
(``g`` the backprops, ``a`` what the op read: activations, one-hot ids, ones for a
bias; ``rules.ghost``). K-FAC (Martens & Grosse 2015) approximates the Fisher block of
the weight by a Kronecker product ``A (x) G`` of the two sides' second moments;
with weight sharing over positions, Eschenhagen et al. 2023 ("Kronecker-Factored
Approximate Curvature for Modern Neural Network Architectures") give two forms:

- ``"expand"``: every position a sample of its own: ``A = sum_{n,t} a a^T / (N T)``,
  ``G = sum_{n,t} g g^T / N``;
- ``"reduce"``: positions pooled per sample: ``A = sum_n abar abar^T / N`` with
  ``abar = mean_t a``, ``G = sum_n gbar gbar^T / N`` with ``gbar = sum_t g``.

The backprops are those of one of three matrices (each sample's own loss ``L_n``,
``F = sum_n J_n^T H J_n / N`` for some ``H`` at the output):

- ``"type-2"``: the GGN: the columns of each sample's loss Hessian at its output,
  ``H_n = S_n S_n^T``, pulled back one backward each, all in one batched backward;
- ``"mc"``: the Fisher by Monte Carlo: the loss gradient at labels drawn from the
  model's predictive distribution (``torch.nn`` cross-entropy: categorical; MSE:
  Gaussian of variance 1/2; BCE with logits: Bernoulli), averaged over ``mc_samples``;
- ``"empirical"``: the empirical Fisher: the loss gradient at the given labels.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import hessian, vmap

from . import checks
from .engine import Captured, Factors, cotangent_backprops, loss_backprops, write_per_sample
from .engine.factored_batch import parameter_groups
from .engine.uses import use_factors
from .errors import internal
from .loss import per_sample_losses
from .memory import result_empty
from .precision import accumulate_dtype, without_autocast

FISHERS = ("type-2", "mc", "empirical")
KINDS = ("expand", "reduce")


@dataclass
class KroneckerFactors:
    """One use's K-FAC factors of a parameter seen as a matrix ``(rows, cols)``
    (:func:`persample.engine.factored_batch.matrix_shape`): its curvature block ``~ A (x) G``.

    Attributes:
        A: the input side's second moment ``(d_in, d_in)``, or for a lookup (whose input
            side is the one-hot id of each position) its diagonal ``(vocabulary,)``.
        G: the output side's ``(d_out, d_out)``, from the backprops.
        rows: ``"G"`` when ``G`` acts on the parameter's rows (``nn.Linear``'s weight
            ``(out, in)``), ``"A"`` when ``A`` does (``x @ W`` with ``W (in, out)``,
            GPT-2's ``Conv1D``, an embedding table ``(vocabulary, d)``).
    """

    A: Tensor
    G: Tensor
    rows: str


class _Moments:
    """Running sums of one use's factors and what they are divided by; the sums of
    outer products are written in place, in persample's result memory (a fresh
    ``9216 x 9216`` factor costs its page faults, as much as its product)."""

    def __init__(self) -> None:
        self.a: Tensor | None = None  # sum of the input side's outer products (or counts)
        self.a_count = 0  # positions (expand) or samples (reduce) summed into a
        self.g: Tensor | None = None  # sum of the output side's outer products
        self.rows = "G"

    def add(self, a: Tensor | None, a_count: int, g: Tensor, g_scale: float) -> None:
        """Add ``a^T a`` (``a (m, d_in)``; a lookup's counts ``(vocabulary,)`` as they
        are; ``None``: nothing) and ``g_scale g^T g`` (``g (m', d_out)``)."""
        if a is not None:
            self.a = _add_moment(self.a, a, 1.0)
        self.g = _add_moment(self.g, g, g_scale)
        self.a_count += a_count


def _add_moment(total: Tensor | None, x: Tensor, scale: float) -> Tensor:
    """``total + scale x^T x`` in place (``x (m, d)``), or ``+ x`` for a vector."""
    if x.dim() == 1:
        return x.clone() if total is None else total.add_(x)
    if total is None:
        d = x.shape[1]
        total = result_empty(d * d, x.dtype, x.device).view(d, d)
        return torch.mm(x.T, x, out=total).mul_(scale) if scale != 1.0 else torch.mm(
            x.T, x, out=total)
    return total.addmm_(x.T, x, alpha=scale)


def _divided(t: Tensor, by: float) -> Tensor:
    """``t / by`` in persample's result memory."""
    return torch.div(t, by, out=result_empty(t.numel(), t.dtype, t.device).view(t.shape))


class KFAC:
    """K-FAC factors of a model's parameters, accumulated over batches, from persample's
    captured activations and backprops: every op with factors (``nn.Linear`` and
    ``F.linear``, ``addmm``/GPT-2's ``Conv1D``, ``x @ W``, embedding lookups, 1-d and 2-d
    convolutions over their patches without groups), tied and
    shared parameters with every use; the exact diagonal of the curvature for the
    parameters without factors (normalisation scales, grouped convolutions, recurrent
    weights),
    from their per-sample gradients.

    Args:
        model: the ``nn.Module``; its output one tensor with the samples in dim 0
            (``"type-2"``: ``(B, C)``), or for ``"empirical"`` any output the loss reads
            (a Hugging Face ``ModelOutput``).
        fisher: ``"type-2"`` (the GGN, exact in its columns), ``"mc"`` or
            ``"empirical"`` (see the module's docstring).
        kind: ``"expand"`` or ``"reduce"`` (Eschenhagen et al. 2023); lookups are
            always expanded (their input side's second moment is the ids' frequencies,
            a diagonal).
        params: names or parameters to cover (default every trainable one).
        mc_samples: labels drawn per sample for ``"mc"``, ``>= 1``.
        generator: a ``torch.Generator`` for ``"mc"``'s draws.
        shared: a parameter several ops read (tied weights): ``"each"``, one pair of
            factors per use (its block is their sum); ``"diagonal"``, its exact
            diagonal instead (one Kronecker product per parameter, as inverting wants).

    Attributes:
        num_data: the samples accumulated so far.

    Raises:
        ValueError: an unknown ``fisher`` or ``kind``, ``mc_samples < 1``; at
            :meth:`update`, a loss ``"mc"`` cannot sample from, or an output
            ``"type-2"`` cannot take.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from persample.curvature import KFAC
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        >>> kfac = KFAC(net, fisher="type-2")
        >>> kfac.update(torch.randn(16, 4), torch.randint(0, 3, (16,)), nn.CrossEntropyLoss())
        >>> [(f.A.shape, f.G.shape) for f in kfac.factors["0.weight"]]
        [(torch.Size([4, 4]), torch.Size([8, 8]))]
        >>> kfac.num_data
        16

    Source: Martens & Grosse 2015 (K-FAC); Grosse & Martens 2016 (K-FAC for weight
    sharing); Eschenhagen et al. 2023 (expand and reduce); Kunstner et al. 2019 (the
    empirical Fisher, and why the other two are preferred).
    """

    def __init__(self, model: nn.Module, *, fisher: str = "type-2", kind: str = "expand",
                 params: Iterable[str | Tensor] | None = None, mc_samples: int = 1,
                 generator: torch.Generator | None = None, shared: str = "each") -> None:
        if fisher not in FISHERS:
            raise ValueError(f"fisher must be one of {FISHERS}, got {fisher!r}")
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 1:
            raise ValueError(f"mc_samples must be an int >= 1, got {mc_samples!r}")
        if shared not in ("each", "diagonal"):
            raise ValueError(f"shared must be 'each' or 'diagonal', got {shared!r}")
        self.model, self.fisher, self.kind, self.shared = model, fisher, kind, shared
        self.mc_samples, self.generator = mc_samples, generator
        every = checks.trainable_parameters(model)
        self.params = checks.selected_parameters(model, every, params)
        self.num_data = 0
        self._moments: dict[str, list[_Moments]] = {}
        self._diagonal: dict[str, Tensor] = {}

    def update(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], Tensor]) -> None:
        """Add one batch: one forward and one batched backward of ``v`` cotangents per
        sample (``"type-2"``: the output's size ``C``; ``"mc"``: ``mc_samples``;
        ``"empirical"``: 1).

        Args:
            inputs, targets, loss_fn: as for :func:`persample.per_sample_grads` (each
                sample's own loss ``L_n``).

        Raises:
            ValueError: a loss ``"mc"`` cannot sample from (not ``CrossEntropyLoss``,
                ``MSELoss`` or ``BCEWithLogitsLoss``), an output ``"type-2"`` cannot take
                (not ``(B, C)``), and the errors of ``per_sample_grads``' validation.
        """
        batch, n, _ = checks.validate_call(self.model, inputs, targets, loss_fn, "rules",
                                           None)
        if n == 0:
            return
        captured = self.capture(batch, targets, loss_fn, self.params)
        scale = 1.0 / self.mc_samples if self.fisher == "mc" else 1.0
        with torch.no_grad(), without_autocast(), internal("the factor rules"):
            factored = self._add_factors(captured, scale)
            self._add_diagonals(captured, factored, scale)
        self.num_data += n

    @property
    def factors(self) -> dict[str, list[KroneckerFactors]]:
        """``{name: [KroneckerFactors of each use]}`` for the parameters with factors
        (a tied parameter has one per use), normalised by the samples so far."""
        out = {}
        for name, uses in self._moments.items():
            out[name] = [KroneckerFactors(_divided(m.a, m.a_count), _divided(m.g, self.num_data),
                                          m.rows) for m in uses]
        return out

    @property
    def diagonals(self) -> dict[str, Tensor]:
        """``{name: tensor of the parameter's shape}``: the exact diagonal of the
        curvature of the parameters without factors."""
        return {name: d / self.num_data for name, d in self._diagonal.items()}

    # -- one batch ---------------------------------------------------------------------

    def capture(self, batch: Any, targets: Any, loss_fn: Callable,
                params: dict[str, nn.Parameter]) -> Captured:
        """One forward and the backward of this Fisher's cotangents, the backprops at
        every op reading ``params``: the empirical Fisher's are the per-sample losses'
        own (any output the loss reads); the others' come from the output, one tensor."""
        watched = {id(p): p for p in params.values()}
        if self.fisher == "empirical":  # (a batch of one captured too: its factors)
            return loss_backprops(self.model, batch, targets, loss_fn, watched, records=True)
        cotangents, v = self._cotangents(targets, loss_fn)
        return cotangent_backprops(self.model, batch, cotangents, watched, v, records=True)

    def _cotangents(self, targets: Any, loss_fn: Callable) -> tuple[Callable, int]:
        """The cotangents' function of the output ``(v, n, *out)``, and ``v`` as far as
        known before the output is (``"type-2"``: the output's size)."""
        if self.fisher == "mc":
            draw = label_sampler(loss_fn, self.generator)
            return (lambda out: torch.stack([draw(out, targets)
                                             for _ in range(self.mc_samples)]),
                    self.mc_samples)
        return lambda out: hessian_columns(out, targets, loss_fn), 1

    def _add_factors(self, captured: Captured, scale: float) -> set[int]:
        """Each factored use's sums, column by column; the ids of the parameters done."""
        names = {id(p): name for name, p in self.params.items()}
        v = captured.v
        done: set[int] = set()
        for column in range(v):
            found = use_factors(captured, set(names), column=column if v > 1 else None,
                                curvature=True)
            for pid, (_, uses) in found.items():
                if len(uses) > 1 and self.shared == "diagonal":
                    continue  # (its exact diagonal)
                moments = self._moments.setdefault(names[pid], [_Moments() for _ in uses])
                table = captured.param(pid).shape[0] if captured.param(pid).dim() else 1
                for m, f in zip(moments, uses):
                    a, count, g, rows = _sides(f, self.kind, table, first=column == 0)
                    m.rows = rows
                    m.add(a, count, g, scale)
                done.add(pid)
        return done

    def _add_diagonals(self, captured: Captured, factored: set[int], scale: float) -> None:
        """The exact curvature diagonal ``sum_{n, v} g_nv^2`` of the other parameters."""
        rest = {name: p for name, p in self.params.items() if id(p) not in factored}
        if not rest:
            return
        v = captured.v
        dest = {id(p): p.new_zeros((captured.n, v, *p.shape),
                                   dtype=accumulate_dtype(p.dtype)) for p in rest.values()}
        write_per_sample(captured, dest)
        for name, p in rest.items():
            # in place: a table's (n, v, *shape) squared into new memory costs its page
            # faults (1.3 s for GPT-2's 50257 x 768 at B=8), the square itself a tenth
            d = dest.pop(id(p)).square_().sum((0, 1))
            if scale != 1.0:
                d.mul_(scale)
            if name in self._diagonal:
                self._diagonal[name].add_(d)
            else:
                self._diagonal[name] = d


def _sides(f: Factors, kind: str, table: int, first: bool
           ) -> tuple[Tensor | None, int, Tensor, str]:
    """One use's input side as the rows whose outer products sum to its moment (a
    lookup's id counts; ``None`` after the first column: it does not depend on the
    cotangent), its count, its output side likewise, and which acts on the parameter's
    rows (``table``: a lookup's rows)."""
    grads, read = (f.left, f.right) if f.backprops == "left" else (f.right, f.left)
    rows = "G" if f.backprops == "left" else "A"
    n, t = read.shape[:2]
    g = grads.reshape(n * t, -1) if kind == "expand" else grads.sum(1)  # (m, d_out)
    if not first:
        return None, 0, g, rows
    if not read.is_floating_point():  # a lookup's one-hot ids: their frequencies
        counts = torch.bincount(read.reshape(-1), minlength=table)[:table]
        return counts.to(grads.dtype), n * t, g, rows
    if kind == "expand":
        return read.reshape(n * t, -1), n * t, g, rows
    return read.mean(1), n, g, rows


# -- the cotangents -------------------------------------------------------------------


def loss_gradient(output: Tensor, targets: Any, loss_fn: Callable) -> Tensor:
    """``(n, *out)``: each sample's loss gradient at its own output, ``dL_n / d out_n``.

    Examples:
        >>> out = torch.tensor([[0.0, 0.0]])
        >>> loss_gradient(out, torch.tensor([0]), nn.CrossEntropyLoss())
        tensor([[-0.5000,  0.5000]])
    """
    with torch.enable_grad():
        out = output.detach().requires_grad_(True)
        losses = per_sample_losses(out, targets, loss_fn, len(out))
        (grad,) = torch.autograd.grad(losses.sum(), out)
    return grad


def label_sampler(loss_fn: Callable, generator: torch.Generator | None
                  ) -> Callable[[Tensor, Any], Tensor]:
    """``draw(output, targets)``: one Monte Carlo cotangent ``(n, *out)``, the loss
    gradient at labels drawn from the predictive distribution the loss is the negative
    log-likelihood of, times ``sqrt(m)`` where each sample's loss is a mean of ``m``
    terms (so that its expected outer product is the loss Hessian, the GGN's):
    cross-entropy: categorical over dim 1 (``ignore_index`` positions of the given
    targets stay ignored); MSE: ``y = f + e``, ``e ~ N(0, 1/2)``; BCE with logits:
    Bernoulli.

    Raises:
        ValueError: another loss, or a loss with class weights or label smoothing.

    Examples:
        >>> draw = label_sampler(nn.MSELoss(reduction="sum"), torch.Generator().manual_seed(0))
        >>> draw(torch.zeros(3, 2), None).shape
        torch.Size([3, 2])
    """
    kind = type(loss_fn)
    if kind not in (nn.CrossEntropyLoss, nn.MSELoss, nn.BCEWithLogitsLoss) or (
            getattr(loss_fn, "weight", None) is not None
            or getattr(loss_fn, "label_smoothing", 0.0) != 0
            or getattr(loss_fn, "pos_weight", None) is not None):
        raise ValueError(
            "Monte Carlo curvature (fisher='mc', mc_samples > 0) draws labels from the "
            "distribution the loss is the negative log-likelihood of: pass "
            "nn.CrossEntropyLoss, nn.MSELoss or nn.BCEWithLogitsLoss without weights or "
            f"smoothing (got {loss_fn!r}); or use the exact form (fisher='type-2', "
            "mc_samples=0), which takes any loss")

    def draw(output: Tensor, targets: Any) -> Tensor:
        n = len(output)
        if kind is nn.CrossEntropyLoss:
            classes = output.shape[1]
            probs = output.softmax(1).movedim(1, -1).reshape(-1, classes)
            labels = probs.multinomial(1, generator=generator).reshape(
                n, *output.shape[2:])
            if isinstance(targets, Tensor) and targets.shape == labels.shape:
                labels = torch.where(targets == loss_fn.ignore_index, targets, labels)
            terms = labels[0].numel() if output.dim() > 2 else 1
        elif kind is nn.MSELoss:
            noise = torch.randn(output.shape, generator=generator, dtype=output.dtype,
                                device=output.device)
            labels = output + math.sqrt(0.5) * noise
            terms = output[0].numel()
        else:
            labels = torch.bernoulli(output.sigmoid(), generator=generator)
            terms = output[0].numel()
        grad = loss_gradient(output, labels, loss_fn)
        if loss_fn.reduction == "mean" and terms > 1:
            grad = grad * math.sqrt(terms)
        return grad

    return draw


def hessian_columns(output: Tensor, targets: Any, loss_fn: Callable) -> Tensor:
    """``(C, n, C)``: the columns of each sample's loss Hessian's square root at its
    output ``(n, C)``: ``H_n = S_n S_n^T`` (eigen-decomposition, negative eigenvalues
    cut to 0), column ``c`` for every sample at once.

    Raises:
        ValueError: an output that is not ``(n, C)``, or targets that are not a tensor
            with the samples in dim 0.

    Examples:
        >>> cols = hessian_columns(torch.zeros(2, 3), torch.tensor([0, 1]),
        ...                        nn.CrossEntropyLoss())
        >>> cols.shape, torch.allclose(torch.einsum("cni,cnj->nij", cols, cols)[0],
        ...                            torch.eye(3) / 3 - 1 / 9)
        (torch.Size([3, 2, 3]), True)
    """
    if output.dim() != 2:
        raise ValueError(f"fisher='type-2' takes a model output (B, C), got "
                         f"{tuple(output.shape)}: use fisher='mc' for outputs with positions")
    if not isinstance(targets, Tensor) or len(targets) != len(output):
        raise ValueError("fisher='type-2' needs the targets as one tensor with the samples "
                         "in dim 0")

    def one(o: Tensor, y: Tensor) -> Tensor:
        return loss_fn(o.unsqueeze(0), y.unsqueeze(0)).sum()

    with torch.enable_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated",
                                DeprecationWarning)  # (torch's forward-mode decompositions)
        h = vmap(hessian(one))(output.detach(), targets)  # (n, C, C)
    values, vectors = torch.linalg.eigh(h)
    root = vectors * values.clamp(min=0).sqrt().unsqueeze(1)  # (n, C, C): columns u_k sqrt(l_k)
    return root.permute(2, 0, 1)  # (C, n, C)


# -- GGN diagonals ---------------------------------------------------------------------


def per_sample_ggn_diag(model: nn.Module, inputs: Any, targets: Any,
                        loss_fn: Callable[[Any, Any], Tensor], *, mc_samples: int = 0,
                        flat: bool = False, params: Iterable[str | Tensor] | None = None,
                        generator: torch.Generator | None = None) -> dict[str, Tensor] | Tensor:
    """Each sample's diagonal of the generalized Gauss-Newton matrix, ``diag(J_n^T H_n
    J_n)`` (``H_n`` its loss's Hessian at its output ``(C,)``, ``J_n`` the Jacobian of
    its output), without the ``(B, P)`` gradients of all parameters at once.

    ``mc_samples=0``: exact, ``sum_c (J_n^T s_nc)^2`` over the columns of ``H_n``'s
    square root (one batched backward of ``C`` cotangents; BackPACK's
    ``BatchDiagGGNExact``); ``mc_samples=m``: the Monte Carlo estimate from ``m`` labels
    drawn from the model's distribution (MC Fisher, BackPACK's ``BatchDiagGGNMC``; a
    ``torch.nn`` cross-entropy, MSE or BCE-with-logits loss).

    Args:
        model, inputs, targets, loss_fn: as for :func:`persample.per_sample_grads` (each
            sample's own loss); exact: the model's output ``(B, C)``.
        mc_samples: 0 (exact) or the labels drawn per sample.
        flat: one ``(B, P)`` tensor (``named_parameters()`` order) instead of a dict.
        params: names or parameters (default every trainable one).
        generator: for the Monte Carlo draws.

    Returns:
        ``{name: (B, *param.shape)}`` (or ``(B, P)``), in loss units per parameter unit
        squared, in the parameters' dtype or float32 if that is lower.

    Warns:
        UserWarning: an empty batch (0 samples): zeros of the result's shapes.

    Raises:
        ValueError: ``mc_samples < 0``, an output exact cannot take (not ``(B, C)``), a
            loss MC cannot sample from; the errors of ``per_sample_grads``.
        FloatingPointError: exact (``mc_samples=0``), a sample whose output holds a NaN
            or an Inf (named).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from persample.curvature import per_sample_ggn_diag
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        >>> d = per_sample_ggn_diag(net, torch.randn(5, 4), torch.randint(0, 3, (5,)),
        ...                         nn.CrossEntropyLoss())
        >>> d["0.weight"].shape, bool((d["0.weight"] >= 0).all())
        (torch.Size([5, 8, 4]), True)

    Source: Martens 2020 and Schraudolph 2002 (the GGN); Dangel, Kunstner & Hennig 2020
    (BackPACK: its per-sample diagonals by backpropagating the Hessian's square root).
    """
    return _ggn_rows(model, inputs, targets, loss_fn, mc_samples, params, generator,
                     per_sample=True, flat=flat)


def ggn_diag(model: nn.Module, inputs: Any, targets: Any,
             loss_fn: Callable[[Any, Any], Tensor], *, mc_samples: int = 0,
             params: Iterable[str | Tensor] | None = None,
             generator: torch.Generator | None = None) -> dict[str, Tensor]:
    """The diagonal of the batch's GGN, ``sum_n diag(J_n^T H_n J_n)``, as
    :func:`per_sample_ggn_diag` summed over the samples, formed a few parameters at a
    time (never ``(B, P)``).

    Args:
        model, inputs, targets, loss_fn, mc_samples, params, generator: as for
            :func:`per_sample_ggn_diag`.

    Returns:
        ``{name: param.shape}``, loss units per parameter unit squared.

    Warns:
        UserWarning: as :func:`per_sample_ggn_diag`.

    Raises:
        ValueError, FloatingPointError: as :func:`per_sample_ggn_diag`.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from persample.curvature import ggn_diag, per_sample_ggn_diag
        >>> net = nn.Linear(4, 3)
        >>> x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
        >>> total = ggn_diag(net, x, y, nn.CrossEntropyLoss())["weight"]
        >>> each = per_sample_ggn_diag(net, x, y, nn.CrossEntropyLoss())["weight"]
        >>> torch.allclose(total, each.sum(0))
        True

    Source: Martens 2020 (the GGN); Dangel, Kunstner & Hennig 2020 (BackPACK's
    ``DiagGGNExact``).
    """
    return _ggn_rows(model, inputs, targets, loss_fn, mc_samples, params, generator,
                     per_sample=False)


def _ggn_rows(model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable,
              mc_samples: int, params: Any, generator: torch.Generator | None,
              per_sample: bool, flat: bool = False) -> dict[str, Tensor] | Tensor:
    """The GGN diagonal of each parameter, per sample or summed."""
    if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 0:
        raise ValueError(f"mc_samples must be an int >= 0 (0: exact), got {mc_samples!r}")
    batch, n, chosen = checks.validate_call(model, inputs, targets, loss_fn, "rules", None,
                                            params)
    function = "per_sample_ggn_diag" if per_sample else "ggn_diag"
    checks.warn_empty(function, n)
    if n == 0:
        result, dest = _rows_result(chosen, n, flat, per_sample)
        for t in dest.values():
            t.zero_()
        return result
    if mc_samples:
        draw = label_sampler(loss_fn, generator)
        captured = cotangent_backprops(
            model, batch, lambda out: torch.stack([draw(out, targets)
                                                   for _ in range(mc_samples)]),
            {id(p): p for p in chosen.values()}, mc_samples)
    else:
        captured = cotangent_backprops(
            model, batch, lambda out: hessian_columns(_finite(out, function), targets, loss_fn),
            {id(p): p for p in chosen.values()})
    scale = 1.0 / mc_samples if mc_samples else 1.0
    names = {id(p): name for name, p in chosen.items()}
    result, dest = _rows_result(chosen, n, flat, per_sample)
    with torch.no_grad(), internal("the rules"):
        done = set()
        for pid, (rows, cols) in _single_position_sides(captured, set(names)).items():
            shape = (rows.shape[1], cols.shape[1])
            if per_sample:  # (n, r, c): each sample's outer product
                torch.mul(rows[:, :, None], cols[:, None, :], out=dest[pid].view(n, *shape))
            else:  # (r, c): their sum, one product over the samples
                torch.mm(rows.T, cols, out=dest[pid].view(shape))
            done.add(pid)
        rest = [p for p in chosen.values() if id(p) not in done]
        for group in parameter_groups(rest, n * captured.v):
            _formed_rows(captured, group, dest, per_sample)
        if scale != 1.0:
            for t in dest.values():
                t.mul_(scale)
    return result


def _finite(out: Tensor, function: str) -> Tensor:
    """``out`` ``(n, ...)``, the model's output; a ``FloatingPointError`` naming the samples
    whose output holds a NaN or an Inf (the loss's Hessian there has no eigenvectors)."""
    bad = checks.non_finite_samples(out) if isinstance(out, Tensor) else []
    if bad:
        raise FloatingPointError(
            f"{function}: the output of samples {bad[:10]}{'...' if len(bad) > 10 else ''} "
            "is not finite (NaN or Inf), so the loss's curvature there is not either. Check "
            "those samples' inputs, or leave them out.")
    return out


def _rows_result(chosen: dict[str, nn.Parameter], n: int, flat: bool, per_sample: bool
                 ) -> tuple[dict[str, Tensor] | Tensor, dict[int, Tensor]]:
    """The result and its parts by parameter id: per sample, ``(n, *shape)`` views of one
    block of persample's result memory (pages already touched: a fresh ``(B, P)`` costs
    its page faults, more than the products), ``(n, P)`` with ``flat``; summed,
    ``(*shape)`` zeros. In the accumulation dtype."""
    first = next(iter(chosen.values()))
    dtype = accumulate_dtype(first.dtype)
    if not per_sample:
        dest = {id(p): torch.zeros(p.shape, dtype=accumulate_dtype(p.dtype), device=p.device)
                for p in chosen.values()}
        return {name: dest[id(p)] for name, p in chosen.items()}, dest
    total = sum(p.numel() for p in chosen.values())
    block = result_empty(n * total, dtype, first.device)
    dest, at = {}, 0
    if flat:  # each parameter's columns of the (n, P) rows
        rows = block.view(n, total)
        for p in chosen.values():
            dest[id(p)] = rows[:, at:at + p.numel()].view(n, *p.shape)
            at += p.numel()
        return rows, dest
    for p in chosen.values():
        dest[id(p)] = block[at:at + n * p.numel()].view(n, *p.shape)
        at += n * p.numel()
    return {name: dest[id(p)] for name, p in chosen.items()}, dest


def _formed_rows(captured: Captured, group: list[nn.Parameter], dest: dict[int, Tensor],
                 per_sample: bool) -> None:
    """``group``'s rows from each sample's formed gradient of every column,
    ``J_n^T s_nv`` ``(n, v, *shape)``, squared and summed over the columns (and over the
    samples) into ``dest``; with one column, per sample: formed in ``dest`` itself."""
    n, v = captured.n, captured.v
    if v == 1 and per_sample:
        cols = {id(p): dest[id(p)].zero_().unsqueeze(1) for p in group}
        write_per_sample(captured, cols)
        for t in cols.values():
            t.square_()
        return
    like = dest[id(group[0])]
    sizes = [n * v * p.numel() for p in group]
    block, at = result_empty(sum(sizes), like.dtype, like.device), 0
    cols = {}
    for p, size in zip(group, sizes):
        cols[id(p)] = block[at:at + size].view(n, v, *p.shape).zero_()
        at += size
    write_per_sample(captured, cols)
    for pid, c in cols.items():
        c.square_()
        if per_sample:
            torch.sum(c, 1, out=dest[pid])
        else:
            dest[pid].copy_(c.sum((0, 1)))


def _single_position_sides(captured: Captured, wanted: set[int]
                           ) -> dict[int, tuple[Tensor, Tensor]]:
    """``{id(p): (rows (n, r), cols (n, c))}`` for the parameters read once, by an op with
    factors at one position (a linear layer on vectors): sample ``n``'s gradient for
    column ``v`` is ``L_nv R_nv^T``, its square ``L_nv^2 (R_nv^2)^T``; the side the op
    read is the same for every column, so the sum over the columns is the outer product
    of the backprops' squares summed over the columns with that side squared (BackPACK's
    trick for the diagonal, without forming any gradient)."""
    sides: dict[int, list] = {}
    single = None
    for column in range(captured.v):
        found = use_factors(captured, wanted, column=column if captured.v > 1 else None)
        if single is None:
            single = {pid for pid, (_, uses) in found.items()
                      if len(uses) == 1 and uses[0].left.is_floating_point()
                      and uses[0].right.shape[1] == 1}
        for pid in single:
            f = found[pid][1][0]
            grads, read = (f.left, f.right) if f.backprops == "left" else (f.right, f.left)
            squares = grads[:, 0].square()  # (n, d_out)
            if pid in sides:
                sides[pid][0].add_(squares)
            else:
                sides[pid] = [squares, read[:, 0].square(), f.backprops == "left"]
    return {pid: (g, a) if left else (a, g) for pid, (g, a, left) in sides.items()}
