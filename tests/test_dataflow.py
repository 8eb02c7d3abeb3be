"""Each mechanism of the data-flow engine on a small hand-written model, against the loop
in float64, with sizes that coincide (batch = sequence length = heads = windows), so
that a guess of where the batch is from a size would show.

For every model, through ``battery.check``: every public function is exact (with the
rules and ``auto``; ``param_jacobian`` too where the model returns one tensor), no
warning at all, ``supported`` reports the path the call took, and the model is left as
it was.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import persample
import zoo
from battery import ANY, TOL, assert_grads_equal, check
from persample import (
    loop_per_sample_grads,
    per_sample_grads,
    supported,
)
from persample.batch import SHARED, Batched, Ctx, Mixed, Unknown, propagate

B = T = H = 4  # coinciding on purpose
E = 8
def mse(out, y):
    return ((out - y) ** 2).flatten(1).sum(1)


# ---------------------------------------------------------------------------
# parameters used on data without samples


class Positions(nn.Module):
    """A learned position table read with ``arange(T)`` ids (GPT-2, BERT, BART), added to
    the tokens: its per-sample gradient comes from the broadcast add."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(10, E)
        self.pos = nn.Embedding(T, E)
        self.out = nn.Linear(E, 3)

    def forward(self, ids: Tensor) -> Tensor:
        positions = torch.arange(ids.shape[1]).unsqueeze(0)  # (1, T): no samples
        h = self.tok(ids) + self.pos(positions)
        return self.out(torch.tanh(h)).sum(1)


class BiasTable(nn.Module):
    """T5's relative attention bias: a table read through a ``(T, T)`` bucket matrix (T = B
    = heads), ``(1, H, T, T)``, added to each sample's scores."""

    def __init__(self):
        super().__init__()
        self.qk = nn.Linear(E, 2 * E)
        self.bias = nn.Embedding(7, H)

    def forward(self, x: Tensor) -> Tensor:
        n, t, _ = x.shape
        q, k = self.qk(x).view(n, t, 2, H, -1).unbind(2)  # (n, T, H, d)
        scores = q.transpose(1, 2) @ k.transpose(1, 2).transpose(2, 3)  # (n, H, T, T)
        buckets = (torch.arange(t)[None, :] - torch.arange(t)[:, None]).clamp(-3, 3) + 3
        table = self.bias(buckets).permute(2, 0, 1).unsqueeze(0)  # (1, H, T, T)
        scores += table  # in place, as T5 does
        return scores.softmax(-1).flatten(1)


class ClassToken(nn.Module):
    """A class token expanded to the batch and joined to each sample's patches."""

    def __init__(self):
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, E))
        self.proj = nn.Linear(E, E)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.cat([self.cls.expand(x.shape[0], -1, -1), self.proj(x)], 1)  # (B, 1+T, E)
        return torch.tanh(h).sum(1)


@pytest.mark.parametrize("make, inputs, targets", [
    (Positions, lambda: torch.randint(0, 10, (B, T)), lambda: torch.randn(B, 3)),
    (BiasTable, lambda: torch.randn(B, T, E), lambda: torch.randn(B, H * T * T)),
    (ClassToken, lambda: torch.randn(B, T, E), lambda: torch.randn(B, E)),
], ids=["positions-from-arange", "bias-table-t-by-t", "class-token"])
def test_parameters_on_data_without_samples(make, inputs, targets):
    torch.manual_seed(0)
    check(make(), inputs(), targets(), mse, jacobian=True, forbid=ANY)


# ---------------------------------------------------------------------------
# where the batch is: sequence-first, merged with positions or windows


class SequenceFirst(nn.Module):
    """Works on ``(T, B, E)`` with T == B: a Linear and a LayerNorm see the batch in dim 1."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(E, E)
        self.norm = nn.LayerNorm(E)

    def forward(self, x: Tensor) -> Tensor:  # x (B, T, E)
        h = self.norm(self.fc(x.transpose(0, 1)))  # (T, B, E)
        return h.transpose(0, 1).flatten(1)


class MergedRows(nn.Module):
    """OPT-style ``(B*T, E)`` rows, and an ``addmm`` with a ``(in, out)`` weight (GPT-2's
    ``Conv1D``), then back to ``(B, T, E)``."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, E) / math.sqrt(E))
        self.bias = nn.Parameter(torch.randn(E))
        self.norm = nn.LayerNorm(E)

    def forward(self, x: Tensor) -> Tensor:
        n, t, e = x.shape
        rows = torch.addmm(self.bias, x.reshape(-1, e), self.weight)  # (B*T, E)
        return self.norm(rows).view(n, t, e).flatten(1)


class Windows(nn.Module):
    """Swin-style windows merged into dim 0: ``(B, 4, 4, C) -> (B*nW, 4, C)`` with
    nW == B, a Linear and a norm over the windows, and back."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.norm = nn.LayerNorm(3)

    def forward(self, x: Tensor) -> Tensor:  # (B, 4, 4, 3)
        n = x.shape[0]
        w = x.view(n, 2, 2, 2, 2, 3).permute(0, 1, 3, 2, 4, 5).reshape(-1, 4, 3)  # (B*4, 4, 3)
        w = self.norm(self.fc(w))
        back = w.view(n, 2, 2, 2, 2, 3).permute(0, 1, 3, 2, 4, 5).reshape(n, 4, 4, 3)
        return back.flatten(1)


class InnerMerge(nn.Module):
    """``(T, B, E) -> (T*B, E)``: the samples are the inner part of dim 0."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(E, 2)

    def forward(self, x: Tensor) -> Tensor:
        t = x.transpose(0, 1).reshape(-1, E)  # (T*B, E)
        return self.fc(t).view(x.shape[1], x.shape[0], 2).transpose(0, 1).flatten(1)


@pytest.mark.parametrize("make, shape, out", [
    (SequenceFirst, (B, T, E), T * E),
    (MergedRows, (B, T, E), T * E),
    (Windows, (B, 4, 4, 3), 48),
    (InnerMerge, (B, T, E), T * 2),
], ids=["sequence-first", "merged-rows-addmm", "windows", "inner-merge"])
def test_batch_moved_or_merged(make, shape, out):
    torch.manual_seed(0)
    check(make(), torch.randn(*shape), torch.randn(B, out), mse, jacobian=True, forbid=ANY)


# ---------------------------------------------------------------------------
# parameters by op, whatever the module class


class HandRMSNorm(nn.Module):
    """Llama's RMSNorm: ``weight * x * rsqrt(mean(x^2) + eps)``."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E))

    def forward(self, x: Tensor) -> Tensor:
        dtype = self.weight.dtype  # reading .dtype is not a use
        h = x.to(dtype) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h


class LayerScaled(nn.Module):
    """timm's LayerScale in place (``x.mul_(gamma)``), a bias added by hand, an in-place
    residual, and GELU."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(E, E)
        self.gamma = nn.Parameter(torch.randn(E))
        self.shift = nn.Parameter(torch.randn(E))
        self.norm = HandRMSNorm()

    def forward(self, x: Tensor) -> Tensor:
        h = F.gelu(self.fc(self.norm(x)))
        h.mul_(self.gamma)
        h = h + self.shift
        h += x
        return h.flatten(1)


class TwiceRegistered(nn.Module):
    """Opacus's DPRNN pattern: one weight registered on the module and on its child."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(E, 3)
        self.weight = self.inner.weight  # the same Parameter, a second name

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x).sum(1)


class InPlaceResidual(nn.Module):
    """torchvision's BasicBlock: conv-bn-ReLU(inplace), conv-bn, ``out += identity``,
    ReLU(inplace)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3)
        self.conv2, self.bn2 = nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        out = F.relu(out, inplace=True)
        return out.flatten(1)


class InPlaceThroughViews(nn.Module):
    """``F.linear`` on a sequence returns a view; ops in place through other views of it
    (``h[:, 0] += p``, ``h[:, 1:3] = ...``) re-base the view's own autograd node, so its
    backprops are read at its base's node."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, E)
        self.p = nn.Parameter(torch.randn(E))
        self.q = nn.Parameter(torch.randn(2, E))

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x)  # (B, T, E)
        h[:, 0] += self.p
        h[:, 1:3] = torch.tanh(h[:, 1:3]) + self.q
        out = torch.zeros_like(h)
        out.copy_(h)
        return torch.tanh(out).flatten(1)


@pytest.mark.parametrize("make, shape, out", [
    (InPlaceThroughViews, (B, T, 3), T * E),
    (LayerScaled, (B, T, E), T * E),
    (TwiceRegistered, (B, T, E), 3),
    (InPlaceResidual, (B, 3, T, T), 3 * T * T),
], ids=["inplace-through-views", "rmsnorm-layerscale-inplace", "weight-registered-twice",
        "inplace-residual"])
def test_parameters_by_op(make, shape, out):
    torch.manual_seed(0)
    model = make().eval()
    check(model, torch.randn(*shape), torch.randn(B, out), mse, jacobian=True, forbid=ANY)


def test_weight_registered_twice_is_one_parameter():
    """Not twice its gradient: the loop and the rules agree, and the result has it once."""
    torch.manual_seed(0)
    model = TwiceRegistered()
    x, y = torch.randn(B, T, E), torch.randn(B, 3)
    got = per_sample_grads(model, x, y, mse)
    assert list(got) == ["weight", "inner.bias"]  # named_parameters(): each once
    manual = torch.stack([torch.autograd.grad(mse(model(x[i:i + 1]), y[i:i + 1]).sum(),
                                              model.inner.weight)[0] for i in range(B)])
    torch.testing.assert_close(got["weight"], manual, **TOL)


# ---------------------------------------------------------------------------
# inputs and outputs as libraries use them


class KeywordModel(nn.Module):
    """``forward(input_ids, attention_mask=None, position_ids=None)`` returning a dict."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, E)
        self.pos = nn.Embedding(T, E)
        self.head = nn.Linear(E, 3)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        h = self.emb(input_ids)
        if position_ids is not None:
            h = h + self.pos(position_ids)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        return {"logits": self.head(h).sum(1), "hidden": h}


def dict_loss(out, y):
    return F.cross_entropy(out["logits"], y, reduction="none")


@pytest.mark.parametrize("form", ["dict", "args-kwargs", "shared-position-ids"])
def test_inputs_as_a_dict(form):
    torch.manual_seed(0)
    model = KeywordModel()
    ids = torch.randint(0, 10, (B, T))
    mask = torch.ones(B, T)
    mask[0, -1] = 0
    y = torch.randint(0, 3, (B,))
    if form == "dict":
        inputs = {"input_ids": ids, "attention_mask": mask}
    elif form == "args-kwargs":
        inputs = ((ids,), {"attention_mask": mask})
    else:  # a (1, T) tensor: shared by all samples, passed by keyword only
        inputs = {"input_ids": ids, "position_ids": torch.arange(T)[None]}
    used = {"rule"} if form == "shared-position-ids" else {"rule", "unused"}  # model.pos
    check(model, inputs, y, dict_loss, forbid=ANY, paths=used)  # a dict output: no Jacobian
    assert_grads_equal(per_sample_grads(model, inputs, y, dict_loss, chunk_size=3),
                 loop_per_sample_grads(model, inputs, y, dict_loss))


def test_batch_encoding_from_transformers():
    transformers = zoo.require("transformers")
    torch.manual_seed(0)
    model = KeywordModel()
    enc = transformers.BatchEncoding({"input_ids": torch.randint(0, 10, (B, T)),
                                      "attention_mask": torch.ones(B, T)})
    y = torch.randint(0, 3, (B,))
    assert_grads_equal(per_sample_grads(model, enc, y, dict_loss),
                 loop_per_sample_grads(model, dict(enc), y, dict_loss))


class ComputesItsLoss(nn.Module):
    """Like a Hugging Face model given ``labels``: its ``loss`` is a mean over every token
    of every sample, which cannot be split by sample."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, E)
        self.head = nn.Linear(E, 10)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.emb(input_ids))  # (B, T, 10)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return out


def test_a_loss_computed_inside_the_model_is_refused_with_the_fix():
    torch.manual_seed(0)
    model = ComputesItsLoss()
    ids = torch.randint(0, 10, (B, T))
    labels = ids.clone()
    labels[0, 2:] = -100  # padding: per-sample token counts differ
    inputs = {"input_ids": ids, "labels": labels}
    with pytest.raises(persample.LossNotPerSampleError, match="(?s)output\\['loss'\\].*logits"):
        per_sample_grads(model, inputs, None, lambda out, _: out["loss"], method="rules")
    with pytest.raises(persample.LossNotPerSampleError, match="causal LM"):
        per_sample_grads(model, inputs, None, lambda out, _: out["loss"] * 2, method="rules")
    # auto: a warning with the fix, then the loop's answer (each sample's own mean)
    with pytest.warns(UserWarning, match="per-sample terms"):
        got = per_sample_grads(model, inputs, None, lambda out, _: out["loss"])
    assert_grads_equal(got, loop_per_sample_grads(model, inputs, None, lambda out, _: out["loss"]))


def test_the_per_sample_loss_from_the_logits_is_exact():
    torch.manual_seed(0)
    model = ComputesItsLoss()
    ids = torch.randint(0, 10, (B, T))
    labels = ids.clone()
    labels[0, 2:] = -100

    def loss_fn(out, labels):
        per_token = F.cross_entropy(out["logits"].transpose(1, 2), labels, reduction="none")
        return per_token.sum(1) / (labels != -100).sum(1)

    check(model, {"input_ids": ids}, labels, loss_fn, forbid=ANY)  # a dict: no Jacobian


# ---------------------------------------------------------------------------
# what the engine cannot follow: exact slower paths, named


@torch.jit.script
def _double(x: Tensor) -> Tensor:  # TorchScript: its ops are not seen by the capture
    return 2 * x


class OpaqueInside(nn.Module):
    """TorchScript on per-sample data: what comes out of it has no known layout."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(_double(x)).sum(1)


def test_unknown_layout_goes_to_the_whole_model_and_says_so():
    """Never a guess: the rules refuse naming the parameter and why; supported says
    'vmap'; auto warns and takes torch.func over the whole model, which is exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(E, E), OpaqueInside())
    x, y = torch.randn(B, T, E), torch.randn(B, 3)
    with pytest.raises(persample.NeedsWholeModel, match="TorchScript.*module '1.fc'"):
        per_sample_grads(model, x, y, mse, method="rules")
    assert {r.path for r in supported(model, x)} == {"vmap"}
    with pytest.warns(UserWarning, match="TorchScript"):
        got = per_sample_grads(model, x, y, mse)
    assert_grads_equal(got, loop_per_sample_grads(model, x, y, mse))


class _Gain(torch.autograd.Function):
    """``x * w`` as a custom autograd.Function (torch.func can batch it)."""

    @staticmethod
    def forward(x, w):
        return x * w

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum_to_size(w.shape)


_Gain.generate_vmap_rule = True


class CustomGain(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(E))

    def forward(self, x: Tensor) -> Tensor:
        return _Gain.apply(x, self.w)


def test_parameter_inside_a_custom_function_takes_the_module_fallback():
    """The capture sees ``x * w`` run without autograd inside the Function: the
    gradient path is the Function's own, so the module is differentiated whole with
    torch.func (the per-module fallback), and the rest stays on rules."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(E, E), CustomGain(), nn.Linear(E, 2))
    x, y = torch.randn(B, E), torch.randn(B, 2)
    routes = {r.module: (r.path, r.reason) for r in supported(model, x)}
    assert routes["0"][0] == routes["2"][0] == "rule"
    assert routes["1"][0] == "fallback"
    check(model, x, y, mse, jacobian=True, forbid=ANY, paths={"rule", "fallback"})


class SumsOverTheBatch(nn.Module):
    """Subtracts the batch mean: samples interact, per-sample gradients follow the loop's
    definition (each sample alone)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        return h - h.mean(0, keepdim=True)


def test_mixing_samples_is_named_and_refused_the_loop_only_when_asked():
    """A model that mixes samples has no per-sample gradient in the batch's sense: the
    rules name the op, ``auto`` refuses (the loop's each-sample-alone answer fails the
    certificate), and ``method="loop"`` gives that answer when asked for."""
    from persample.errors import CertificateError

    torch.manual_seed(0)
    model = SumsOverTheBatch()
    x, y = torch.randn(B, E), torch.randn(B, 3)
    with pytest.raises(ValueError, match="reduces over the batch, in module '<root>'"):
        per_sample_grads(model, x, y, mse, method="rules")
    with pytest.warns(UserWarning, match="reduces over the batch"):
        with pytest.raises(CertificateError, match="mixes samples.*reduces over the batch"):
            per_sample_grads(model, x, y, mse)
    got = per_sample_grads(model, x, y, mse, method="loop")
    assert_grads_equal(got, loop_per_sample_grads(model, x, y, mse))


# ---------------------------------------------------------------------------
# the data-flow rules themselves


def flow(func, args, kwargs, out, layouts):
    ctx = Ctx(B, lambda t: next((lay for x, lay in layouts if x is t), SHARED))
    return propagate(ctx, func, args, kwargs, out).outputs


def test_reshape_merges_by_index_arithmetic():
    x = torch.randn(B, T, E)  # B == T: sizes cannot tell them apart
    merged = x.reshape(B * T, E)
    assert flow(torch.Tensor.reshape, (x, B * T, E), {}, merged, [(x, Batched(0))]) == Batched(
        0, inner=T)
    back = merged.view(B, T, E)
    assert flow(torch.Tensor.view, (merged, B, T, E), {}, back,
                [(merged, Batched(0, inner=T))]) == Batched(0)
    # the batch in dim 1 (sequence-first), merged with the positions in front of it
    seq = torch.randn(T, B, E)
    assert flow(torch.Tensor.reshape, (seq, T * B, E), {}, seq.reshape(T * B, E),
                [(seq, Batched(1))]) == Batched(0, outer=T)
    # a reshape that splits the samples' index digit: not followed
    odd = torch.randn(B, 6)
    assert isinstance(flow(torch.Tensor.reshape, (odd, 3, 8), {}, odd.reshape(3, 8),
                           [(odd, Batched(0))]), Unknown)


def test_a_reshape_of_one_sample_keeps_the_batch_dim_it_leaves_alone():
    """At n = 1 the samples' digit has radix 1 and fits in any dim: a reshape that
    leaves the batch dim alone keeps it (FSDP2's ``view_as`` of each block's input);
    one that merges it follows the index arithmetic as for any n."""
    ctx = Ctx(1, lambda t: Batched(0))
    for before, after, want in [((1, 8), (1, 8), Batched(0)), ((1, 2, 4), (1, 8), Batched(0)),
                                ((1, 8), (1, 1, 8), Batched(0)),
                                ((1, 8), (8,), Batched(0, inner=8))]:
        x = torch.randn(before)
        got = propagate(ctx, torch.Tensor.reshape, (x, *after), {}, x.reshape(after))
        assert got.outputs == want, (before, after)


def test_transpose_and_broadcast_follow_the_dims():
    x = torch.randn(B, T, E)
    assert flow(torch.Tensor.transpose, (x, 0, 1), {}, x.transpose(0, 1),
                [(x, Batched(0))]) == Batched(1)
    pos = torch.randn(1, T, E)  # shared, shaped like one sample
    assert flow(torch.Tensor.add, (x, pos), {}, x + pos, [(x, Batched(0))]) == Batched(0)
    y = torch.randn(T, B, E)
    assert isinstance(flow(torch.Tensor.add, (x, y), {}, x + y,
                           [(x, Batched(0)), (y, Batched(1))]), Mixed)


def test_index_values_decide_the_samples():
    logits = torch.randn(B, T, 3)
    last = torch.tensor([3, 2, 3, 1])
    rows = torch.arange(B)
    got = flow(torch.Tensor.__getitem__, (logits, (rows, last)), {}, logits[rows, last],
               [(logits, Batched(0)), (last, Batched(0))])
    assert got == Batched(0)
    shuffled = torch.tensor([1, 0, 3, 2])
    got = flow(torch.Tensor.__getitem__, (logits, (shuffled, last)), {},
               logits[shuffled, last], [(logits, Batched(0)), (last, Batched(0))])
    assert not (isinstance(got, Batched) and got.index is None)


def test_reductions_over_the_batch_mix():
    x = torch.randn(B, T)
    assert isinstance(flow(torch.Tensor.sum, (x, 0), {}, x.sum(0), [(x, Batched(0))]), Mixed)
    assert flow(torch.Tensor.sum, (x, 1), {}, x.sum(1), [(x, Batched(0))]) == Batched(0)
    assert flow(torch.Tensor.sum, (x, 0), {}, x.sum(0), []) is SHARED


class FlatLogits(nn.Module):
    """Returns ``(B*T, V)`` logits, as many LM heads do before the loss."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, E)
        self.head = nn.Linear(E, 10)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.emb(ids)).reshape(-1, 10)


def test_scalar_loss_on_merged_outputs_is_cut_per_sample():
    """A scalar loss over ``(B*T, V)`` rows with ``ignore_index``: each sample's own mean
    over its own tokens (the rows are cut by sample), not the batch's mean times B."""
    torch.manual_seed(0)
    model = FlatLogits()
    ids = torch.randint(0, 10, (B, T))
    labels = ids.clone()
    labels[0, 1:] = -100  # sample 0 has one token, the others four

    def loss_fn(out, y):
        return F.cross_entropy(out, y.reshape(-1), ignore_index=-100)

    assert_grads_equal(per_sample_grads(model, ids, labels, loss_fn, method="rules"),
                 loop_per_sample_grads(model, ids, labels, loss_fn))


# ---------------------------------------------------------------------------
# the data flow of ops the architectures of 2025-26 use


class AssembledKeys(nn.Module):
    """DeepSeek's latent attention builds its keys in a fresh tensor, ``new_empty`` then
    ``k[..., :d].copy_(nope)`` and ``k[..., d:].copy_(rope)``: the slices of a shared
    tensor written with sample data make it batched where they were written."""

    def __init__(self):
        super().__init__()
        self.nope = nn.Linear(E, H * 3)
        self.rope = nn.Linear(E, 2)
        self.out = nn.Linear(H * 5, 3)

    def forward(self, x: Tensor) -> Tensor:  # (b, t, E)
        b, t, _ = x.shape
        nope = self.nope(x).view(b, t, H, 3).transpose(1, 2)  # (b, H, t, 3)
        rope = self.rope(x).view(b, 1, t, 2).expand(-1, H, -1, -1)  # (b, H, t, 2)
        keys = nope.new_empty(b, H, t, 5)
        keys[..., :3].copy_(nope)
        keys[..., 3:].copy_(rope)
        return self.out(keys.transpose(1, 2).reshape(b, t, -1)).sum(1)


class Triangular(nn.Module):
    """Gated DeltaNet's chunks solve a per-sample unit lower-triangular system
    (``linalg.solve_triangular``): the batch stays in the systems' batch dim."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(E, T)
        self.b = nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:  # (b, T, E)
        lower = torch.tril(torch.tanh(self.a(x)) * 0.3, -1) + torch.eye(T)  # (b, T, T)
        solved = torch.linalg.solve_triangular(lower, self.b(x), upper=False,
                                               unitriangular=True)  # (b, T, 3)
        right = torch.linalg.solve_triangular(lower.transpose(1, 2), self.b(x).transpose(1, 2),
                                              upper=True, left=False)  # (b, 3, T)
        return solved.sum(1) + right.sum(2)


class NewTensors(nn.Module):
    """Reformer's ``x.new(sizes)``, and ``x.new_tensor(data)`` of per-sample data."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:  # (b, E)
        fresh = x.new(x.shape[0], 3).fill_(0.5)  # no sample's data
        copied = x.new_tensor(x[:, :3])  # the samples' own data, no gradient
        return self.lin(x) * fresh + copied


@pytest.mark.filterwarnings("ignore:To copy construct")  # (new_tensor of a tensor: meant)
@pytest.mark.parametrize("model", [AssembledKeys, Triangular, NewTensors])
def test_the_data_flow_of_newer_ops(model):
    torch.manual_seed(0)
    net = model().double()
    x = torch.randn(B, T, E, dtype=torch.float64) if model is not NewTensors else (
        torch.randn(B, E, dtype=torch.float64))
    torch.manual_seed(1)
    check(net, x, torch.randn(B, 3, dtype=torch.float64), mse)


class RowsAsSequences(nn.Module):
    """timm's Sequencer: an image's columns run as sequences by a recurrent layer, the
    samples merged with the columns in the kernel's batch dim (``(B W, H, C)``; batch
    second with ``first=False``)."""

    def __init__(self, kind: str, first: bool):
        super().__init__()
        self.first = first
        self.rnn = getattr(nn, kind)(3, 5, batch_first=first, bidirectional=True)
        self.fc = nn.Linear(10, 3)

    def forward(self, x: Tensor) -> Tensor:  # (b, H, W, C)
        b, h, w, c = x.shape
        v = x.permute(0, 2, 1, 3).reshape(-1, h, c)  # (b W, H, C)
        v = self.rnn(v if self.first else v.transpose(0, 1))[0]
        v = (v if self.first else v.transpose(0, 1)).reshape(b, w, h, -1)
        return self.fc(v).mean((1, 2))


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("first", [True, False], ids=["batch-first", "batch-second"])
def test_sequences_merged_with_the_samples_keep_them(kind, first):
    """A recurrent kernel over several sequences per sample (the samples merged with an
    image's columns) runs each sequence on its own: the samples are kept (they were taken
    for mixed, and the whole model went to torch.func); the kernel's parameters take its
    exact per-op VJP, the rest the rules."""
    torch.manual_seed(0)
    net = RowsAsSequences(kind, first).double()
    x = torch.randn(B, T, 3, 3, dtype=torch.float64)  # (B = H = 4; W = C = 3)
    torch.manual_seed(1)
    y = torch.randn(B, 3, dtype=torch.float64)
    check(net, x, y, mse, paths=None, forbid=None)
    paths = {r.module: r.path for r in persample.supported(net, x, y, mse)}
    assert paths == {"rnn": "op vjp", "fc": "rule"}, paths


class Bucketed(nn.Module):
    """Idefics3's patch positions: each sample's fractional coordinates (from its own
    mask's count) put in buckets of shared boundaries by ``bucketize``, looked up in a
    position table; ``searchsorted`` of the features in a shared sorted sequence scales
    them. With ``own``, each sample searches its own sorted features (boundaries that
    hold samples: not followed, answered exactly all the same)."""

    def __init__(self, own: bool = False):
        super().__init__()
        self.own = own
        self.table = nn.Embedding(T, E)
        self.lin = nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:  # (b, T, E)
        count = (x[..., 0] > -0.5).sum(1).clamp(min=1)  # (b,)
        coords = torch.arange(T, dtype=x.dtype)[None, :] / count[:, None]  # (b, T)
        bounds = torch.arange(1, T, dtype=x.dtype) / T
        h = x + self.table(torch.bucketize(coords.clamp(max=0.999), bounds, right=True))
        if self.own:
            sequence = h[..., 0].sort(-1).values  # (b, T)
            scale = torch.searchsorted(sequence.contiguous(), h[..., 0].contiguous())
        else:
            scale = torch.searchsorted(torch.linspace(-1, 1, 5, dtype=x.dtype), h[..., 0])
        return self.lin(h * scale[..., None].to(x.dtype)).sum(1)


@pytest.mark.parametrize("own", [False, True], ids=["shared-boundaries", "own-boundaries"])
def test_buckets_of_shared_boundaries_keep_the_samples(own):
    """``bucketize`` and ``searchsorted`` by shared boundaries take the rules (Idefics3's
    vision embeddings: their position ids had no data-flow rule); a sample's own
    boundaries are not followed and still answered exactly."""
    torch.manual_seed(0)
    net = Bucketed(own).double()
    x = torch.randn(B, T, E, dtype=torch.float64)
    torch.manual_seed(1)
    y = torch.randn(B, 3, dtype=torch.float64)
    if own:
        with pytest.raises(persample.NeedsWholeModel, match="searchsorted of boundaries"):
            persample.per_sample_grads(net, x, y, mse, method="rules")
        check(net, x, y, mse, methods=("auto",), paths=None, forbid=None)
    else:
        check(net, x, y, mse, forbid=ANY)


def test_a_slice_written_with_another_samples_data_is_not_followed():
    """Sample data written into a slice at other samples' positions (rows rolled by one,
    then paired with each sample's target) is not followed: the rules refuse by the op
    that mixed what was written, and ``auto`` says the model mixes samples."""
    class Rolled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(E, E)

        def forward(self, x):
            h = self.lin(x)
            buf = h.new_zeros(x.shape[0], 2 * E)
            buf[:, :E].copy_(h.roll(1, 0))
            return buf[:, E:] + buf[:, :E]

    torch.manual_seed(0)
    net = Rolled().double()
    x, y = torch.randn(B, E, dtype=torch.float64), torch.randn(B, E, dtype=torch.float64)
    assert {r.path for r in supported(net, x, y, mse)} == {"vmap"}
    with pytest.raises(persample.LossNotPerSampleError, match="roll"):
        per_sample_grads(net, x, y, mse, method="rules")
    with pytest.raises(persample.CertificateError, match="mixes samples"):
        per_sample_grads(net, x, y, mse)  # (the certificate: no method agrees with the batch)


@pytest.mark.parametrize("picked", ["none", "some"])
def test_rows_written_through_a_mask(picked):
    """``out[mask] = h[mask]`` into a shared tensor, the mask from the data: picking some
    rows (each gets its own sample's data), or none (nothing written: ``out`` stays
    shared). Both take the rules and equal the loop."""
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.head = nn.Linear(E, E), nn.Linear(E, 3)

        def forward(self, x):
            h = self.lin(x)
            out = torch.zeros_like(h)
            mask = x[:, 0] > (0.0 if picked == "some" else 1e9)
            out[mask] = h[mask]
            return self.head(out + h)

    torch.manual_seed(0)
    net = Masked().double()
    x, y = torch.randn(B, E, dtype=torch.float64), torch.randn(B, 3, dtype=torch.float64)
    x[:, 0] = torch.linspace(-1, 1, B, dtype=torch.float64)  # (some rows picked, not all)
    assert {r.path for r in supported(net, x, y, mse)} == {"rule"}
    check(net, x, y, mse)


@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
def test_masks_resized_as_one_images_channels_keep_the_samples(mode):
    """A batch of masks resized as the channels of one image (``mask[None]``, DETR's pixel
    mask brought to its feature map's size): each channel is resized alone, so each keeps
    its sample (whole-model ``torch.func`` before); the batch size equals the channels."""

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.head = nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.Linear(3, 3)

        def forward(self, x, mask):  # (b, 2, 8, 8), (b, 8, 8)
            h = self.conv(x)  # (b, 3, 4, 4)
            kw = {} if mode == "nearest" else {"align_corners": False}
            m = F.interpolate(mask[None].to(h.dtype), size=h.shape[-2:], mode=mode, **kw)[0]
            return self.head((h * m[:, None]).mean((2, 3)))

    torch.manual_seed(0)
    net = Masked().double()
    x, mask = torch.randn(3, 2, 8, 8, dtype=torch.float64), torch.rand(3, 8, 8) > 0.3
    y = torch.randn(3, 3, dtype=torch.float64)
    assert {r.path for r in supported(net, (x, mask), y, mse)} == {"rule"}
    check(net, (x, mask), y, mse)
