"""Random projections of per-sample gradients, without the ``(B, P)`` tensor.

Data attribution at scale works on projected gradients: TRAK (Park et al. 2023)
projects each per-sample gradient to a few thousand dimensions with a dense random
(Johnson-Lindenstrauss) matrix; LoGra (Choe et al. 2024) and LESS (Xia et al. 2024)
project each layer's gradient ``G = sum_t g_t a_t^T`` as ``P_out^T G P_in``, which
needs only the projected backprops ``P_out^T g_t`` and activations ``P_in^T a_t``.

:class:`GradientProjector` does both on any model persample runs; ``kind`` picks the
class that does it (``GradientProjector(...)`` returns an instance of it):

- :class:`KroneckerProjector`, ``kind="kronecker"``: every parameter seen as a matrix
  ``(rows, cols)`` (its first dim by the rest) gets ``P_out (rows, d_out)`` and ``P_in
  (cols, d_in)`` with Gaussian entries of variance ``1/d_out`` and ``1/d_in`` (the
  identity for a side kept whole: a bias's ``P_in``, a small parameter's both); ``dim``
  is split across the parameters in equal shares, capped by each one's size, and each
  share taken as the pair ``d_out * d_in`` near its square root
  (:attr:`GradientProjector.dims` says the split). Where an op gives the parameter's
  per-sample gradient as factors (linear maps at ``T`` positions, table lookups:
  ``rules.ghost``), the projection is ``sum_t (P_out^T L_t) (P_in^T R_t)^T`` from
  them; elsewhere from the per-sample gradients, a few parameters at a time.
- :class:`DenseProjector`, ``kind="gaussian"`` / ``"rademacher"``: one dense matrix
  ``(P, dim)`` over all the parameters (entries ``N(0, 1/dim)`` or ``+-1/sqrt(dim)``),
  never stored whole: each parameter's block of rows is drawn in chunks from ``(seed,
  parameter, chunk)`` whenever it is applied, to the per-sample gradients of a few
  parameters at a time.

The matrices are the same for the same seed, parameters and device type.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from . import checks
from .certificate import Checker, certify_projection, check_option, signature
from .engine import Factors
from .engine.factored_batch import FactoredBatch, matrix_shape, parameter_groups
from .errors import internal
from .inputs import Batch
from .methods import Taken, answer
from .precision import accumulate_dtype, cast
from .whole import loop_grads, vmap_grads

KINDS = ("kronecker", "gaussian", "rademacher")
CHUNK_BYTES = 1 << 26
"""At most this many bytes of a dense projection's rows are drawn at once."""


class GradientProjector:
    """A seeded random linear map from per-sample gradients to ``dim`` numbers each.

    ``GradientProjector(model, dim, kind=...)`` builds an instance of the class of
    ``kind``, :class:`KroneckerProjector` or :class:`DenseProjector` (subclasses of this
    one, which has what they share: the parameters, the batch's capture, ``project``).

    Args:
        model: the ``nn.Module`` whose per-sample gradients are projected.
        dim: the number of projected coordinates per sample, ``>= 1`` (at most the
            number of parameter entries). With ``kind="kronecker"`` it is split across
            the parameters and may come out a little smaller (``proj.dim``; each
            parameter's ``d_out * d_in`` in ``proj.dims``).
        kind: ``"kronecker"`` (default; per parameter ``P_out^T G P_in``, LoGra's form),
            ``"gaussian"`` or ``"rademacher"`` (one dense JL matrix, TRAK's).
        seed: the seed of every random matrix (an ``int``).
        params: the parameters projected, as names or the parameters (default: every
            trainable one, in ``named_parameters()`` order).

    Attributes:
        dim: the projected coordinates per sample (``int``).
        dims: ``{name: (d_out, d_in)}`` for ``kind="kronecker"``; ``{}`` for a dense kind.
        kind, seed, model: as given (``seed`` as an ``int``).
        params: ``{name: parameter}`` projected, in order: ``proj.dim``'s blocks
            (Kronecker) or the dense matrix's blocks of rows follow it.

    Raises:
        ValueError: an unknown ``kind``, ``dim < 1`` or larger than the parameters'
            entries, and ``params`` errors as for :func:`persample.per_sample_grads`.
        TypeError: a complex parameter among those projected (named).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> import persample
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        >>> proj = persample.GradientProjector(net, 20, seed=0)
        >>> z = proj(x, y, nn.CrossEntropyLoss())  # (16, proj.dim), no (16, P) tensor
        >>> grads = persample.per_sample_grads(net, x, y, nn.CrossEntropyLoss())
        >>> z.shape, torch.allclose(z, proj.project(grads), atol=1e-5)
        (torch.Size([16, 20]), True)
        >>> type(proj).__name__, isinstance(proj, persample.GradientProjector)
        ('KroneckerProjector', True)

    Source: Johnson & Lindenstrauss 1984; Park et al. 2023 (TRAK); Choe et al. 2024
    (LoGra: Kronecker-structured gradient projection); Xia et al. 2024 (LESS).
    """

    kinds: tuple[str, ...] = KINDS
    """The ``kind`` values this class draws."""

    def __new__(cls, *args: Any, kind: str = "kronecker", **kwargs: Any) -> GradientProjector:
        if cls is GradientProjector:  # the kind's class (a subclass named is built as is)
            if kind not in _CLASSES:
                raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
            cls = _CLASSES[kind]
        return object.__new__(cls)

    def __init__(self, model: nn.Module, dim: int, *, kind: str = "kronecker", seed: int = 0,
                 params: Iterable[str | Tensor] | None = None) -> None:
        if kind not in self.kinds:
            raise ValueError(f"kind must be one of {self.kinds}, got {kind!r}")
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.params = checks.selected_parameters(model, trainable, params)
        checks.real_parameters(self.params, "GradientProjector")
        total = sum(p.numel() for p in self.params.values())
        if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= total:
            raise ValueError(f"dim must be an int in [1, {total}] (the entries of the "
                             f"parameters projected), got {dim!r}")
        self.model, self.kind, self.seed = model, kind, int(seed)
        self.index = {name: k for k, name in enumerate(self.params)}  # the generators'
        self.dim = dim
        self.dims: dict[str, tuple[int, int]] = {}

    # -- what users call --------------------------------------------------------------

    def __call__(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], Tensor], *,
                 method: str = "auto",
                 check: str | int | None = None) -> Tensor:
        """The projected per-sample gradients of a batch, ``(B, proj.dim)``.

        Args:
            inputs, targets, loss_fn, method: as for
                :func:`persample.per_sample_grads` (``B`` samples).
            check: when the result ``R`` is certified (:mod:`persample.certificate`:
                for Gaussian ``u``, ``u^T R`` is :meth:`project` of the gradient of
                ``sum_i u_i L_i``, one more forward and backward): ``"first"``,
                ``"always"``, ``"never"`` or ``N``.

        Returns:
            ``(B, proj.dim)`` in the parameters' dtype, at least float32 (loss units per
            parameter unit): row ``i`` is ``project`` of sample ``i``'s gradient of its
            own loss.

        Warns:
            UserWarning: an empty batch (the result is then ``(0, proj.dim)``).
            RuntimeWarning: a sample whose projected gradient is not finite, naming it.

        Raises:
            TypeError, ValueError, UnsupportedModuleError, CertificateError: as
                :func:`persample.per_sample_grads`.

        Examples:
            >>> from torch import nn
            >>> proj = GradientProjector(nn.Linear(4, 3), 6, kind="rademacher", seed=1)
            >>> proj(torch.randn(5, 4), torch.randint(0, 3, (5,)), nn.CrossEntropyLoss()).shape
            torch.Size([5, 6])
        """
        with checks.kept_buffers(self.model):  # (the model's buffers left as they were)
            return self._projected(inputs, targets, loss_fn, method, check)

    def _projected(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], Tensor],
                   method: str, check: str | int | None) -> Tensor:
        check_option(check)
        batch, _, params = checks.validate_call(self.model, inputs, targets, loss_fn, method,
                                               None, list(self.params))
        checks.warn_empty("GradientProjector", batch.n)
        if batch.n == 0:
            first = next(iter(params.values()))
            return torch.zeros(0, self.dim, device=first.device, dtype=accumulate_dtype(
                *(p.dtype for p in params.values())))
        checker = Checker(check, self.model, signature("projection", self.model, batch,
                                                       targets, params.values(), id(self)))
        kept: list[Tensor] = []

        def certify(how: str, draws: Any) -> Any:
            got = kept.pop()
            return checker(how, lambda: certify_projection(
                self.model, batch, targets, loss_fn, params, got, self.project, draws, how))
        certify.rejected = checker.rejected

        def keep(got: Tensor) -> Tensor:
            kept.append(got)
            return got

        got = answer(
            method,
            rules=lambda: keep(self._by_rules(batch, targets, loss_fn)),
            vmap=lambda: keep(self.project(vmap_grads(self.model, batch, targets,
                                                      loss_fn, params))),
            loop=lambda: keep(self.project(loop_grads(self.model, batch, targets, loss_fn))),
            taken=Taken(), hint=lambda: checks.dtype_note(batch, params), certify=certify)
        checks.warn_non_finite("GradientProjector", got, "result")
        return got

    def project(self, grads: dict[str, Tensor]) -> Tensor:
        """The same map applied to per-sample gradients given whole.

        Args:
            grads: ``{name: (B, *param.shape)}`` for every projected parameter (as
                :func:`persample.per_sample_grads` returns them; other names ignored).

        Returns:
            ``(B, proj.dim)`` in the gradients' dtype, at least float32.

        Raises:
            ValueError: a projected parameter missing from ``grads``.

        Examples:
            >>> from torch import nn
            >>> proj = GradientProjector(nn.Linear(4, 3), 6, kind="gaussian")
            >>> proj.project({"weight": torch.zeros(5, 3, 4), "bias": torch.ones(5, 3)}).shape
            torch.Size([5, 6])
        """
        missing = [n for n in self.params if n not in grads]
        if missing:
            raise ValueError(f"grads lacks the projected parameters {missing}")
        parts = []
        for name in self.params:
            g = grads[name]  # (B, *shape); a 0-dim parameter's (B,)
            parts.append(self._project_one(name, cast(g.unsqueeze(-1).flatten(1),
                                                      accumulate_dtype(g.dtype))))
        return self._joined(parts)

    def kronecker_factors(self, name: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The Kronecker map of parameter ``name``: its per-sample gradient, as a matrix
        ``G (rows, cols)`` (the first dim by the rest), is projected to
        ``P_out^T G P_in (d_out, d_in)``, flattened into its block of ``proj.dim``.

        Args:
            name: a projected parameter's name (a key of ``proj.params``).
            dtype: the dtype of the matrices returned (drawn in float32 whatever it is).

        Returns:
            ``(P_out (rows, d_out), P_in (cols, d_in))`` on the parameter's device:
            Gaussian entries of variance ``1/d``, or the identity for a side kept whole
            (``d = rows`` or ``d = cols``; ``(d_out, d_in) = proj.dims[name]``).

        Raises:
            KeyError: ``name`` is not projected; ValueError for a dense ``kind``.

        Examples:
            >>> from torch import nn
            >>> proj = GradientProjector(nn.Linear(300, 10), 60)
            >>> p_out, p_in = proj.kronecker_factors("weight", torch.float32)
            >>> proj.dims["weight"], p_out.shape, p_in.shape, torch.equal(p_out, torch.eye(10))
            ((10, 5), torch.Size([10, 10]), torch.Size([300, 5]), True)
        """
        raise ValueError(f"kronecker_factors: this projector's kind is {self.kind!r}")

    # -- what each kind does ----------------------------------------------------------

    def _project_one(self, name: str, g: Tensor) -> Tensor:
        """One parameter's per-sample gradients ``(n, numel)`` projected: ``(n, d)``."""
        raise NotImplementedError

    def _joined(self, parts: list[Tensor]) -> Tensor:
        """The parameters' projections ``(n, d)``, in order, as ``(n, proj.dim)``."""
        raise NotImplementedError

    def _from_factors(self, factors: dict[int, list[Factors]], dtype: torch.dtype
                      ) -> dict[str, Tensor]:
        """``{name: (n, d)}`` in ``dtype`` for the parameters this kind projects from
        their factors (``factors``: ``{id(p): uses}``); every other parameter's gradients
        are formed. Here none: a map that needs the whole gradient."""
        return {}

    # -- the rules' path --------------------------------------------------------------

    def _by_rules(self, batch: Batch, targets: Any, loss_fn: Callable) -> Tensor:
        """``(B, proj.dim)``: the batch captured once; the parameters with factors from
        them where this kind can, the rest from their gradients a few at a time."""
        side = FactoredBatch(self.model, batch, targets, loss_fn, self.params)
        dtype = accumulate_dtype(*(p.dtype for p in self.params.values()))
        with torch.no_grad(), internal("the projection of factors"):
            parts = self._from_factors(side.factors, dtype)  # {name: (B, d)}
        rest = [p for name, p in self.params.items() if name not in parts]
        names = {id(p): n for n, p in self.params.items()}
        for group in parameter_groups(rest, side.n):
            for pid, g in side.grads(group).items():  # (B, numel)
                with torch.no_grad():
                    parts[names[pid]] = self._project_one(names[pid], g)
        return self._joined([parts[n].to(dtype) for n in self.params])


class KroneckerProjector(GradientProjector):
    """``kind="kronecker"``: each parameter's per-sample gradient ``G (rows, cols)``
    projected to ``P_out^T G P_in (d_out, d_in)``, the blocks concatenated in
    ``proj.params`` order; from the factors ``sum_t (P_out^T L_t) (P_in^T R_t)^T``
    where the rules give them (no ``G`` formed).

    Build it as ``GradientProjector(model, dim)`` (arguments, attributes, methods and
    errors: :class:`GradientProjector`). ``dim`` is split by :func:`_split`.

    Examples:
        >>> from torch import nn
        >>> proj = GradientProjector(nn.Linear(300, 10), 60)
        >>> isinstance(proj, KroneckerProjector), proj.dims, proj.dim
        (True, {'weight': (10, 5), 'bias': (10, 1)}, 60)

    Source: Choe et al. 2024 (LoGra); Xia et al. 2024 (LESS).
    """

    kinds = ("kronecker",)

    def __init__(self, model: nn.Module, dim: int, *, kind: str = "kronecker", seed: int = 0,
                 params: Iterable[str | Tensor] | None = None) -> None:
        super().__init__(model, dim, kind=kind, seed=seed, params=params)
        self.dims = _split(dim, {n: matrix_shape(p) for n, p in self.params.items()})
        self.dim = sum(a * b for a, b in self.dims.values())
        self._drawn: dict[tuple[str, torch.dtype], tuple[Tensor | None, Tensor | None]] = {}

    # the docstring: GradientProjector.kronecker_factors
    def kronecker_factors(self, name: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        rows, cols = matrix_shape(self.params[name])
        p_out, p_in = self._sides(name, dtype)
        eye = lambda n: torch.eye(n, dtype=dtype, device=self.params[name].device)  # noqa: E731
        return (eye(rows) if p_out is None else p_out), (eye(cols) if p_in is None else p_in)

    def _sides(self, name: str, dtype: torch.dtype) -> tuple[Tensor | None, Tensor | None]:
        """:meth:`kronecker_factors` with ``None`` for a side kept whole (never formed: a
        bias of 50,000 entries would make a 10 GB identity), drawn once per dtype."""
        key = (name, dtype)
        if key not in self._drawn:
            p = self.params[name]
            rows, cols = matrix_shape(p)
            d_out, d_in = self.dims[name]
            gen = _generator(p.device, self.seed, self.index[name], 0)
            self._drawn[key] = (_side(rows, d_out, gen, p.device, dtype),  # (rows, d_out)
                                _side(cols, d_in, gen, p.device, dtype))  # (cols, d_in)
        return self._drawn[key]

    def _project_one(self, name: str, g: Tensor) -> Tensor:
        p_out, p_in = self._sides(name, g.dtype)
        m = g.view(g.shape[0], *matrix_shape(self.params[name]))  # (n, rows, cols)
        if p_in is not None:
            m = m @ p_in  # (n, rows, d_in)
        if p_out is not None:
            m = p_out.T @ m  # (n, d_out, d_in)
        return m.flatten(1)  # (n, d_out * d_in)

    def _joined(self, parts: list[Tensor]) -> Tensor:
        return torch.cat(parts, dim=1)  # (n, sum of d_out * d_in)

    def _from_factors(self, factors: dict[int, list[Factors]], dtype: torch.dtype
                      ) -> dict[str, Tensor]:
        return {name: self._project_factors(name, factors[id(p)], dtype)
                for name, p in self.params.items() if factors.get(id(p))}

    def _project_factors(self, name: str, uses: list[Factors], dtype: torch.dtype) -> Tensor:
        """``sum_uses sum_t (P_out^T L_t) (P_in^T R_t)^T`` per sample: ``(n, d_out d_in)``."""
        p_out, p_in = self._sides(name, dtype)
        total = None
        for u in uses:
            right = u.right if p_in is None else u.right @ p_in  # (n, t, d_in)
            if u.ids and p_out is None:  # rows kept whole: each position's row, added
                n, t, d_in = right.shape
                term = right.new_zeros(n, self.dims[name][0], d_in).scatter_add_(
                    1, u.left.unsqueeze(-1).expand(n, t, d_in), right).flatten(1)
            else:
                left = u.left if p_out is None else p_out[u.left] if u.ids else u.left @ p_out
                term = torch.bmm(left.transpose(1, 2), right).flatten(1)  # (n, t, d_out)^T
            total = term if total is None else total + term
        return total


class DenseProjector(GradientProjector):
    """``kind="gaussian"`` or ``"rademacher"``: one dense matrix ``Phi (P, dim)`` over all
    the projected parameters' entries (in ``proj.params`` order, each flattened), with
    entries ``N(0, 1/dim)`` or ``+-1/sqrt(dim)``; ``z_i = g_i Phi``. ``Phi`` is never
    stored: each parameter's block of rows is drawn in chunks of at most
    :data:`CHUNK_BYTES` (float32) from ``(seed, parameter, chunk)`` whenever it is
    applied, so the per-sample gradients are always formed (a few parameters at a time).

    Build it as ``GradientProjector(model, dim, kind=...)`` (arguments, attributes,
    methods and errors: :class:`GradientProjector`).

    Examples:
        >>> from torch import nn
        >>> proj = GradientProjector(nn.Linear(300, 10), 60, kind="rademacher")
        >>> isinstance(proj, DenseProjector), proj.dims, proj.dim
        (True, {}, 60)

    Source: Johnson & Lindenstrauss 1984; Achlioptas 2003 (Rademacher entries); Park et
    al. 2023 (TRAK).
    """

    kinds = ("gaussian", "rademacher")

    def _project_one(self, name: str, g: Tensor) -> Tensor:
        out = g.new_zeros(g.shape[0], self.dim)  # (n, dim)
        for start, block in self._blocks(name, g.dtype):  # block (k, dim)
            out.addmm_(g[:, start : start + block.shape[0]], block)
        return out

    def _joined(self, parts: list[Tensor]) -> Tensor:
        return torch.stack(parts).sum(0)  # (n, dim)

    def _blocks(self, name: str, dtype: torch.dtype) -> Iterator[tuple[int, Tensor]]:
        """Parameter ``name``'s block of ``Phi``: ``(first row, (k, dim))`` chunks."""
        p = self.params[name]
        step = max(1, CHUNK_BYTES // (self.dim * 4))  # rows per chunk: not by dtype
        for chunk, start in enumerate(range(0, p.numel(), step)):
            rows = min(step, p.numel() - start)
            gen = _generator(p.device, self.seed, self.index[name], chunk)
            block = _DRAWS[self.kind](rows, self.dim, gen, p.device)  # (rows, dim) float32
            yield start, block.div_(math.sqrt(self.dim)).to(dtype)


_CLASSES: dict[str, type[GradientProjector]] = {
    kind: cls for cls in (KroneckerProjector, DenseProjector) for kind in cls.kinds}
"""The class of each ``kind``."""


def _split(dim: int, shapes: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """``{name: (d_out, d_in)}``: from the smallest parameter up, an equal share of what
    is left (capped at the parameter's size), as :func:`_factor`'s pair within it; what
    a share could not use passes on, and the largest parameter takes the rest.

    Examples:
        >>> _split(100, {"bias": (8, 1), "weight": (300, 300)})
        {'bias': (8, 1), 'weight': (9, 10)}
    """
    dims, left = {}, dim
    order = sorted(shapes, key=lambda n: shapes[n][0] * shapes[n][1])
    for k, name in enumerate(order):
        rows, cols = shapes[name]
        share = left if k == len(order) - 1 else left // (len(order) - k)
        dims[name] = _factor(min(rows * cols, share), rows, cols)
        left -= dims[name][0] * dims[name][1]
    for name in reversed(order):  # what the last could not use, to the others
        if left == 0:
            break
        a, b = dims[name]
        more = _factor(min(shapes[name][0] * shapes[name][1], a * b + left), *shapes[name])
        left -= more[0] * more[1] - a * b
        dims[name] = more
    return {name: dims[name] for name in shapes}


def _factor(share: int, rows: int, cols: int) -> tuple[int, int]:
    """The ``(d_out, d_in)`` with ``d_out * d_in <= share`` (``d_out <= rows``,
    ``d_in <= cols``) whose projection of a rank-one gradient ``u v^T`` varies least:
    ``||P_out^T u||^2 ||P_in^T v||^2 / (||u||^2 ||v||^2)`` is a product of independent
    ``chi^2_d / d`` (exactly 1 for a side kept whole), of relative variance
    ``(1 + 2/d_out)(1 + 2/d_in) - 1``, so the pair is near ``sqrt(share)`` each (not
    ``(share, 1)``, which keeps one direction of the activations); ties to the larger
    product. ``(0, 0)`` for a share of 0.

    Examples:
        >>> _factor(79, 50257, 768), _factor(79, 30, 1)
        ((7, 11), (30, 1))
    """
    if share == 0:
        return 0, 0
    best, best_key = (0, 0), None
    for d_out in range(1, min(rows, share) + 1):
        d_in = min(cols, share // d_out)
        key = (_spread(d_out, rows) * _spread(d_in, cols), -d_out * d_in)
        if best_key is None or key < best_key:
            best, best_key = (d_out, d_in), key
    return best


def _side(size: int, d: int, gen: torch.Generator, device: torch.device,
          dtype: torch.dtype) -> Tensor | None:
    """One side of a Kronecker map, ``(size, d)``: ``None`` for the identity where
    ``d = size`` (that side kept whole, exactly), else Gaussian entries of variance
    ``1/d``, drawn in float32 whatever the dtype (the same matrix for every precision)."""
    if d == size:
        return None
    return (torch.randn(size, d, generator=gen, device=device) / math.sqrt(max(d, 1))).to(dtype)


def _spread(d: int, size: int) -> float:
    """``E[X^2]`` of ``X = ||P^T u||^2 / ||u||^2`` for one side ``P (size, d)`` of the map:
    ``1 + 2/d`` for Gaussian ``P``, 1 for the identity (``d = size``)."""
    return 1.0 if d == size else 1 + 2 / d


def _generator(device: torch.device, seed: int, parameter: int, chunk: int) -> torch.Generator:
    """A generator on ``device`` seeded from ``(seed, parameter, chunk)``."""
    mixed = (seed * 1_000_003 + parameter) * 1_000_003 + chunk
    return torch.Generator(device=device).manual_seed(mixed % (1 << 63))


def _gaussian(rows: int, cols: int, gen: torch.Generator, device: torch.device) -> Tensor:
    """``(rows, cols)`` float32 entries ``N(0, 1)`` (the same matrix for every dtype)."""
    return torch.randn(rows, cols, generator=gen, device=device)


def _rademacher(rows: int, cols: int, gen: torch.Generator, device: torch.device) -> Tensor:
    """``(rows, cols)`` float32 entries ``+-1``, each sign with probability 1/2."""
    return torch.randint(0, 2, (rows, cols), generator=gen,
                         device=device).float().mul_(2).sub_(1)


_DRAWS: dict[str, Callable[[int, int, torch.Generator, torch.device], Tensor]] = {
    "gaussian": _gaussian, "rademacher": _rademacher}
"""How a dense kind draws its entries, before the ``1/sqrt(dim)`` scale."""
