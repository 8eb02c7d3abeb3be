"""A batch cut into one sample's pieces and joined again, and rows written by a mask
(a vision-language model's image features, as LLaVA joins them): ``list(h)`` or
``h[i]`` / ``h.select(0, i)`` gives each sample's piece (:class:`~persample.batch.
ops_indexing.Piece`), ``cat``/``stack`` join pieces into a batch dim again, and
``masked_scatter`` writes a source's rows into the rows its mask sets, each of them a
sample's own or the op mixes samples. Against the loop in float64, with the batch size
equal to the image rows per sample and the features (``B = P = E``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import persample
from battery import check
from persample.batch import SHARED, Batched, Ctx, Mixed, Unknown, propagate
from persample.batch.flow import own_piece
from persample.batch.layouts import Piece
from persample.capture.compiled import CompiledCapture
from persample.engine import tapes

B = P = E = 4  # samples, image rows per sample, features: coinciding on purpose
T = 8  # tokens per sample
IMAGE = 9  # the image placeholder's token id


def ce(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


class ImageTokens(nn.Module):
    """LLaVA's join: each image's features ``(P, E)`` listed per image (``list(h)``),
    joined into ``(B*P, E)`` rows and written by ``masked_scatter`` into the rows of each
    sample's image tokens, in order."""

    def __init__(self, pieces: str = "list"):
        super().__init__()
        self.vision = nn.Linear(6, E)
        self.embed = nn.Embedding(10, E)
        self.head = nn.Linear(E, 3)
        self.pieces = pieces

    def forward(self, ids: Tensor, patches: Tensor) -> Tensor:  # (B, T), (B, P, 6)
        h = torch.tanh(self.vision(patches))  # (B, P, E)
        if self.pieces == "list":
            listed = list(h)
        elif self.pieces == "select":
            listed = [h.select(0, i) for i in range(h.shape[0])]
        elif self.pieces == "split":  # (each sample's P rows, cut again: a piece each)
            listed = h.flatten(0, 1).split([P] * h.shape[0])
        elif self.pieces in ("int", "in place"):
            listed = [h[i] for i in range(h.shape[0])]
        else:  # the features as they are: (B, P, E), read in row-major order
            listed = [h]
        features = torch.cat(listed, 0)  # (B*P, E), each sample's rows in turn
        x = self.embed(ids)  # (B, T, E)
        mask = (ids == IMAGE).unsqueeze(-1)  # (B, T, 1): a block of E features per row
        if self.pieces == "in place":
            x = x * 1
            x.masked_scatter_(mask.expand_as(x), features)
        else:
            x = x.masked_scatter(mask, features)
        return self.head(torch.tanh(x)).sum(1)


def image_ids(starts: list[int], counts: list[int] | None = None) -> Tensor:
    """``(B, T)`` ids, sample ``i``'s image tokens at ``starts[i]`` on (``counts[i]`` of
    them, ``P`` by default), the others below the placeholder's id."""
    ids = torch.randint(0, IMAGE, (B, T))
    for i, start in enumerate(starts):
        ids[i, start:start + (P if counts is None else counts[i])] = IMAGE
    return ids


@pytest.mark.parametrize("pieces", ["list", "select", "int", "whole", "in place", "split"])
def test_image_features_written_into_their_tokens_take_the_rules(pieces):
    torch.manual_seed(0)
    model = ImageTokens(pieces)
    ids, patches = image_ids([0, 3, 1, 4]), torch.randn(B, P, 6)
    check(model, (ids, patches), torch.randint(0, 3, (B,)), ce)


def test_the_cached_calls_compile_and_read_each_calls_mask(monkeypatch):
    """The image tokens move at every call: the compiled call decides the write again
    from this call's mask."""
    monkeypatch.setattr(tapes, "COMPILE_AFTER", 0)
    persample.clear_plans()
    ran, finish = [], CompiledCapture.finish

    def spy(self, output):
        done = finish(self, output)
        ran.append(done)
        return done

    monkeypatch.setattr(CompiledCapture, "finish", spy)
    torch.manual_seed(0)
    model, y = ImageTokens(), torch.randint(0, 3, (B,))
    for k in range(5):
        starts = [(i + k) % (T - P + 1) for i in range(B)]
        check(model, (image_ids(starts), torch.randn(B, P, 6)), y, ce, dp=False)
    assert ran[-2:] == [True, True], ran
    plan = persample.verify(model, (image_ids([1, 2, 3, 4]), torch.randn(B, P, 6)), y, ce).plan
    assert plan.startswith("cached: compiled"), plan


def test_image_tokens_that_do_not_match_their_images_are_refused_by_name():
    """Sample 0 with one image token more and sample 1 with one fewer: sample 0's last
    token takes sample 1's first feature row; alone, sample 0 does not run (the
    model's own error, with why the rules left it)."""
    torch.manual_seed(0)
    model = ImageTokens()
    ids = image_ids([0, 2, 1, 0], counts=[P + 1, P - 1, P, P])
    with pytest.raises(RuntimeError, match="masked_scatter puts one sample's source entries "
                       "in another sample's positions"):
        persample.per_sample_grads(model, (ids, torch.randn(B, P, 6)),
                                   torch.randint(0, 3, (B,)), ce)


class PiecesStacked(nn.Module):
    """Each sample's piece taken by ``h[i]`` in reverse order and stacked (an index
    layout: position ``j`` holds sample ``B-1-j``), flipped back, then a layer reads it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(E, E), nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:  # (B, E)
        h = torch.tanh(self.a(x))
        stacked = torch.stack([h[i] for i in reversed(range(h.shape[0]))], 0).flip(0)
        return self.b(stacked * x)


class PiecesWorked(nn.Module):
    """Each sample's piece worked on alone before the join (views, elementwise ops with
    shared tensors), as a model working image by image does."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(E, E), nn.Linear(P * E, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, E))

    def forward(self, x: Tensor) -> Tensor:  # (B, P, E)
        h = self.a(x)
        worked = [(torch.tanh(piece[1:]) * self.scale).flatten().to(x.dtype)
                  for piece in h.unbind(0)]
        return self.b(torch.cat([torch.stack(worked), h[:, 0].repeat(1, P)[:, :E]], 1))


def test_pieces_worked_on_alone_keep_their_sample():
    torch.manual_seed(0)
    check(PiecesWorked(), torch.randn(B, P, E), torch.randint(0, 3, (B,)), ce)


def test_pieces_stacked_in_another_order_keep_each_samples_rows():
    torch.manual_seed(0)
    check(PiecesStacked(), torch.randn(B, E), torch.randint(0, 3, (B,)), ce)


def _layouts(*pairs: tuple[Tensor, object]):
    table = {id(t): lay for t, lay in pairs}
    return Ctx(B, lambda t: table.get(id(t), SHARED))


def test_the_data_flow_of_pieces_and_of_masked_writes():
    h = torch.randn(B, P, E)
    ctx = _layouts((h, Batched(0)))
    listed = h.unbind(0)
    flow = propagate(ctx, torch.Tensor.unbind, (h, 0), {}, listed)
    assert [lay.sample for lay in flow.outputs] == list(range(B))
    assert all(isinstance(lay, Piece) for lay in flow.outputs)
    rows = h.flatten(0, 1)  # (B*P, E): P rows per sample
    merged = Batched(0, index=torch.arange(B).repeat_interleave(P))
    cut = rows.split([P] * B)
    got = propagate(_layouts((rows, merged)), torch.split, (rows, [P] * B), {}, cut).outputs
    assert [lay.sample for lay in got] == list(range(B))
    cut = rows.split([P + 1] + [P] * (B - 2) + [P - 1])  # (a piece with two samples' rows)
    got = propagate(_layouts((rows, merged)), torch.split, (rows, [P + 1] + [P] * (B - 2) +
                                                           [P - 1]), {}, cut).outputs
    assert not any(isinstance(lay, (Piece, Batched)) for lay in got)
    sizes = [P // 2, P - P // 2] + [P] * (B - 1)  # (sample 0's rows in two pieces)
    got = propagate(_layouts((rows, merged)), torch.split, (rows, sizes), {},
                    rows.split(sizes)).outputs
    assert not any(isinstance(lay, (Piece, Batched)) for lay in got)
    # a piece's layout describes its own tensor only: another reads it as Unknown
    pieces = dict(zip(map(id, listed), flow.outputs))
    ctx = Ctx(B, lambda t: pieces.get(id(t), SHARED))
    joined = torch.cat(listed[::-1], 0)  # (B*P, E): sample B-1's rows first
    got = propagate(ctx, torch.cat, (listed[::-1], 0), {}, joined).outputs
    assert isinstance(got, Batched) and got.dim == 0
    assert got.index.tolist() == [s for s in reversed(range(B)) for _ in range(P)]
    both = listed[0] + listed[1]  # (two samples' pieces joined elementwise: not one's)
    got = propagate(ctx, torch.add, (listed[0], listed[1]), {}, both).outputs
    assert isinstance(got, Unknown) and own_piece(Ctx(B, lambda t: got), both) is None
    part = listed[2][1:]  # (one sample's piece and shared data alone: any op, a sum too)
    got = propagate(ctx, torch.Tensor.__getitem__, (listed[2], slice(1, None)), {}, part)
    assert own_piece(Ctx(B, lambda t: got.outputs), part).sample == 2
    summed = part.sum(0)
    ctx = Ctx(B, lambda t: got.outputs if t is part else SHARED)
    got = propagate(ctx, torch.sum, (part, 0), {}, summed).outputs
    assert own_piece(Ctx(B, lambda t: got), summed).sample == 2
    other = listed[0] * 2
    ctx = Ctx(B, lambda t: flow.outputs[0] if t is other else SHARED)
    assert not isinstance(propagate(ctx, torch.cat, ([other], 0), {}, other).outputs, Batched)

    # masked_scatter: rows of the samples' own, of another sample, or shared
    x, src = torch.randn(B, T, E), torch.randn(B * P, E)
    ids = image_ids([0, 3, 1, 4])
    mask = (ids == IMAGE).unsqueeze(-1)
    out = x.masked_scatter(mask, src)
    merged = Batched(0, index=torch.arange(B).repeat_interleave(P))
    ctx = _layouts((x, Batched(0)), (mask, Batched(0)), (src, merged))
    assert propagate(ctx, torch.Tensor.masked_scatter, (x, mask, src), {}, out).outputs == (
        Batched(0))
    whole = src.view(B, P, E)  # (a block of E entries; P blocks per position of the source)
    ctx = _layouts((x, Batched(0)), (mask, Batched(0)), (whole, Batched(0)))
    assert propagate(ctx, torch.Tensor.masked_scatter, (x, mask, whole), {}, out).outputs == (
        Batched(0))
    shifted = Batched(0, index=torch.arange(B).repeat_interleave(P).roll(1))
    ctx = _layouts((x, Batched(0)), (mask, Batched(0)), (src, shifted))
    assert isinstance(propagate(ctx, torch.Tensor.masked_scatter, (x, mask, src), {},
                                out).outputs, Mixed)
    ctx = _layouts((x, Batched(0)), (mask, Batched(0)))  # a shared source: which rows a
    got = propagate(ctx, torch.Tensor.masked_scatter, (x, mask, src), {}, out).outputs  # sample
    assert type(got) is Unknown, got  # takes depends on the others' masks
    ctx = _layouts((x, Batched(0)))  # ... under a shared mask, each row takes fixed ones
    assert propagate(ctx, torch.Tensor.masked_scatter, (x, mask, src), {}, out).outputs == (
        Batched(0))
    ctx = _layouts((mask, Batched(0)), (src, merged))  # a shared target: each row is its
    assert propagate(ctx, torch.Tensor.masked_scatter, (x, mask, src), {}, out).outputs == (
        Batched(0))  # mask's sample's (which of its positions are written)
    ctx = _layouts((src, merged))  # ... under a shared mask too: the rows written hold
    got = propagate(ctx, torch.Tensor.masked_scatter, (x, mask, src), {}, out).outputs
    assert type(got) is Unknown, got  # samples, the others none, in no one dim


class SharedSource(nn.Module):
    """A table of parameters written into each sample's image tokens: which rows a
    sample takes depends on how many the samples before it masked."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(B * P, E))
        self.embed = nn.Embedding(10, E)
        self.head = nn.Linear(E, 3)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids).masked_scatter((ids == IMAGE).unsqueeze(-1), self.table)
        return self.head(torch.tanh(x)).sum(1)


def test_a_shared_source_under_the_samples_masks_is_not_answered_by_the_rules():
    """Alone, each sample takes the table's first rows; in the batch, sample ``i`` takes
    rows ``i*P`` on: no per-sample gradient of the batch, and the certificate says so."""
    torch.manual_seed(0)
    model = SharedSource()
    inputs, y = image_ids([0, 3, 1, 4]), torch.randint(0, 3, (B,))
    assert "rule" not in {r.path for r in persample.supported(model, inputs, y, ce)
                          if "table" in r.params}
    with pytest.raises(persample.CertificateError, match="mixes samples"):
        persample.per_sample_grads(model, inputs, y, ce)


class PieceValueRead(nn.Module):
    """Each sample's rows scaled by a number read out of the next sample's piece: a
    value in Python, which no layout follows (alone, each sample reads its own)."""

    def __init__(self, read):
        super().__init__()
        self.a, self.b = nn.Linear(E, E), nn.Linear(E, 3)
        self.read = read

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        n = x.shape[0]
        return self.b(torch.stack([h[i] * self.read(x[(i + 1) % n]) for i in range(n)]))


@pytest.mark.parametrize("read", [lambda t: float(t.sum()), lambda t: sum(t.tolist())],
                         ids=["float", "tolist"])
def test_a_piece_read_into_python_leaves_the_rules(read):
    torch.manual_seed(0)
    model, x, y = PieceValueRead(read), torch.randn(B, E), torch.randint(0, 3, (B,))
    routes = persample.supported(model, x, y, ce)
    assert {r.path for r in routes} == {"vmap"}
    assert "reads one sample's values into Python" in routes[0].reason
    with pytest.raises(persample.CertificateError, match="mixes samples"):
        persample.per_sample_grads(model, x, y, ce)
