"""Each sample's own loss for torch.nn's losses with reduction "mean"/"sum", computed
with reduction "none" and reduced per sample (no torch.func): the values of the loss on
each sample's slice, exactly; where that form is not known exact, None (the caller then
evaluates the loss sample by sample)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import persample
from persample.loss import stock_per_sample

B = 6


def _sliced(loss_fn, output, targets):
    return torch.stack([loss_fn(output[i:i + 1], targets[i:i + 1]) for i in range(B)])


def _class_targets(shape, classes=5):
    t = torch.randint(0, classes, shape)
    t.view(B, -1)[1, 0] = -100  # an ignored position in sample 1
    t.view(B, -1)[3] = -100  # sample 3 entirely ignored: nan under "mean", as the loss gives
    return t


CLASSES = [  # (loss, output shape, target shape)
    (nn.CrossEntropyLoss, (B, 5), (B,)),
    (nn.CrossEntropyLoss, (B, 5, 4, 3), (B, 4, 3)),
    (nn.NLLLoss, (B, 5, 7), (B, 7)),
]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss, out_shape, t_shape", CLASSES)
def test_class_losses_per_sample(loss, out_shape, t_shape, reduction):
    output = torch.randn(out_shape).log_softmax(1)
    targets = _class_targets(t_shape)
    fn = loss(reduction=reduction)
    got = stock_per_sample(fn, output, targets, B)
    want = _sliced(fn, output, targets)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14, equal_nan=True)
    assert math.isnan(got[3]) == (reduction == "mean")


ELEMENTWISE = [nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.BCEWithLogitsLoss,
               nn.SoftMarginLoss, nn.BCELoss]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss", ELEMENTWISE)
@pytest.mark.parametrize("shape", [(B,), (B, 3), (B, 2, 6)])
def test_elementwise_losses_per_sample(loss, shape, reduction):
    output = torch.rand(shape) if loss is nn.BCELoss else torch.randn(shape)
    targets = torch.rand(shape) if loss in (nn.BCELoss, nn.BCEWithLogitsLoss) else \
        torch.randn(shape)
    fn = loss(reduction=reduction)
    torch.testing.assert_close(stock_per_sample(fn, output, targets, B),
                               _sliced(fn, output, targets), rtol=1e-12, atol=1e-14)


def test_what_is_not_known_exact_is_left_to_the_loop():
    out, t = torch.randn(B, 5), torch.randint(0, 5, (B,))
    assert stock_per_sample(nn.CrossEntropyLoss(weight=torch.rand(5)), out, t, B) is None
    assert stock_per_sample(nn.CrossEntropyLoss(label_smoothing=0.1), out, t, B) is None
    assert stock_per_sample(nn.CrossEntropyLoss(), out, out.softmax(1), B) is None
    assert stock_per_sample(nn.CrossEntropyLoss(reduction="none"), out, t, B) is None
    assert stock_per_sample(nn.MSELoss(), out, out[:, :1], B) is None  # broadcasting
    assert stock_per_sample(nn.BCEWithLogitsLoss(pos_weight=torch.rand(5)), out,
                            out.sigmoid(), B) is None
    assert stock_per_sample(nn.KLDivLoss(reduction="sum"), out, out, B) is None

    class Scaled(nn.CrossEntropyLoss):  # a subclass may compute anything
        def forward(self, x, y):
            return 2 * super().forward(x, y)

    assert stock_per_sample(Scaled(), out, t, B) is None


@pytest.mark.parametrize("make", [nn.CrossEntropyLoss, lambda: nn.CrossEntropyLoss(
    reduction="sum"), nn.MSELoss, lambda: nn.CrossEntropyLoss(weight=torch.rand(3))])
def test_per_sample_grads_with_stock_losses_match_the_loop(make):
    """Through per_sample_grads, stock form or not, the loop's rows in float64."""
    fn = make()
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(B, 4)
    y = torch.randn(B, 3) if isinstance(fn, nn.MSELoss) else torch.randint(0, 3, (B,))
    fast = persample.per_sample_grads(model, x, y, fn)
    slow = persample.loop_per_sample_grads(model, x, y, fn)
    for name in slow:
        torch.testing.assert_close(fast[name], slow[name], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("batch", [B, 1])
def test_a_parameter_read_in_the_loss_is_refused(batch):
    """A ``loss_fn`` reading a trainable parameter (an L2 penalty written into the loss)
    gives it a gradient path outside the forward that no rule attributes: refused, for a
    batch and for a batch of one, and the stock loss beside it changes nothing."""
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    stock = nn.CrossEntropyLoss()

    def penalised(out, y):
        return stock(out, y) + net.weight.square().sum()

    x, y = torch.randn(batch, 3), torch.randint(0, 2, (batch,))
    with pytest.raises(ValueError, match="read in loss_fn"):
        persample.per_sample_grads(net, x, y, penalised, method="rules")
    got = persample.per_sample_grads(net, x, y, stock, method="rules")
    want = persample.loop_per_sample_grads(net, x, y, stock)
    for name in got:
        torch.testing.assert_close(got[name], want[name])
