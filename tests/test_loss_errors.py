"""An exception raised inside the user's ``loss_fn`` comes out unchanged (its type, its
message, raised from the user's code) with one added note that names ``loss_fn``, the
output's type and shape, and the targets' shape and dtype, on every entry point and
every method."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import persample
from persample.dp import PrivateStep, private_grad
from persample.errors import LOSS_NOTE

B, C = 6, 3


class DictNet(nn.Module):
    """Returns a dict, as a Hugging Face model returns a ModelOutput."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, C)

    def forward(self, x):
        return {"logits": self.fc(x)}


def _notes(err: BaseException) -> list[str]:
    return [n for n in getattr(err, "__notes__", ()) if n.startswith(LOSS_NOTE)]


def _calls(model, x, y, loss_fn):
    return {
        "per_sample_grads": lambda: persample.per_sample_grads(model, x, y, loss_fn),
        "loop": lambda: persample.per_sample_grads(model, x, y, loss_fn, method="loop"),
        "vmap": lambda: persample.per_sample_grads(model, x, y, loss_fn, method="vmap"),
        "norms": lambda: persample.per_sample_grad_norms(model, x, y, loss_fn),
        "private_grad": lambda: private_grad(model, x, y, loss_fn, max_grad_norm=1.0,
                                             noise_multiplier=0.0),
        "PrivateStep": lambda: PrivateStep(model, loss_fn, max_grad_norm=1.0,
                                           noise_multiplier=0.0,
                                           expected_batch_size=B).accumulate(x, y),
    }


ENTRIES = list(_calls(None, None, None, None))


def _plain_error(model, x, y, loss_fn) -> BaseException:
    with pytest.raises(Exception) as plain:
        loss_fn(model(x), y)
    return plain.value


@pytest.mark.parametrize("entry", ENTRIES)
def test_class_targets_with_a_trailing_dim(entry):
    model, loss_fn = nn.Linear(4, C), nn.CrossEntropyLoss()
    x, y = torch.randn(B, 4), torch.randint(0, C, (B, 1))
    plain = _plain_error(model, x, y, loss_fn)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # (torch.func raises its own error for a batched call: the note is the same)
    with pytest.raises(Exception if entry == "vmap" else type(plain)) as err:
        _calls(model, x, y, loss_fn)[entry]()
    notes = _notes(err.value)
    assert len(notes) == 1, err.value.__notes__ if hasattr(err.value, "__notes__") else None
    note = notes[0]
    assert "loss_fn CrossEntropyLoss()" in note
    assert "torch.int64" in note and "targets: Tensor (" in note and ", 1) torch.int64" in note
    assert "output: Tensor (" in note and f", {C}) {torch.get_default_dtype()}" in note
    assert "squeeze(-1)" in note
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("entry", ["per_sample_grads", "loop", "private_grad"])
def test_a_dict_output_passed_to_a_torch_loss(entry):
    model, loss_fn = DictNet(), nn.CrossEntropyLoss()
    x, y = torch.randn(B, 4), torch.randint(0, C, (B,))
    plain = _plain_error(model, x, y, loss_fn)
    with pytest.raises(type(plain), match=str(plain).split("\n")[0][:40].replace("(", r"\(")
                       .replace(")", r"\)")) as err:
        _calls(model, x, y, loss_fn)[entry]()
    (note,) = _notes(err.value)
    dtype = torch.get_default_dtype()
    assert "output: dict {'logits': Tensor (" in note and f", {C}) {dtype}}}" in note
    assert "The model returns a dict" in note and "out['logits']" in note


@pytest.mark.parametrize("entry", ["per_sample_grads", "private_grad", "loop"])
def test_float_class_targets(entry):
    model, loss_fn = nn.Linear(4, C), nn.CrossEntropyLoss()
    x, y = torch.randn(B, 4), torch.randint(0, C, (B,)).float()
    plain = _plain_error(model, x, y, loss_fn)
    with pytest.raises(type(plain)) as err:
        _calls(model, x, y, loss_fn)[entry]()
    (note,) = _notes(err.value)
    assert "targets: Tensor (" in note and ") torch.float32" in note.split("targets:")[1]


class Mistake(Exception):
    pass


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_users_own_loss_raises_unchanged(entry):
    """The user's own exception: the same class and message, raised in the user's
    function (the innermost frame), one note naming the function."""
    model = nn.Linear(4, C)
    x, y = torch.randn(B, 4), torch.randn(B, C)

    def my_loss(out, target):
        raise Mistake("wrong targets")

    with pytest.raises(Mistake) as err:
        _calls(model, x, y, my_loss)[entry]()
    assert str(err.value) == "wrong targets" and err.traceback[-1].name == "my_loss"
    (note,) = _notes(err.value)
    assert "loss_fn test_a_users_own_loss_raises_unchanged.<locals>.my_loss" in note
