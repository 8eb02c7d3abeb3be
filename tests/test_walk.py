"""The model's walk kept between calls: every change to its structure is seen."""

import gc
import weakref

import torch
from torch import nn

from persample import per_sample_grads
from persample.walk import named_modules, named_parameters


def _same(model: nn.Module) -> None:
    assert [(n, id(m)) for n, m in named_modules(model)] == [
        (n, id(m)) for n, m in model.named_modules()]
    assert [(n, id(p)) for n, p in named_parameters(model)] == [
        (n, id(p)) for n, p in model.named_parameters()]


def test_the_walk_follows_every_change_of_structure():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 2)))
    _same(model)
    model.append(nn.Linear(2, 2))  # a module added
    _same(model)
    model[2][0] = nn.Linear(4, 2)  # one replaced, deep down
    _same(model)
    model[0].weight = nn.Parameter(torch.randn(4, 3))  # a parameter replaced
    _same(model)
    model[0].register_parameter("extra", nn.Parameter(torch.zeros(1)))  # one registered
    _same(model)
    del model[0].extra  # and deleted
    _same(model)
    model[2]._modules = {"0": nn.Linear(4, 2)}  # a dict rebound
    _same(model)
    shared = model[0]
    model.append(shared)  # a module twice: walked once
    _same(model)


def test_a_class_swapped_is_walked_again():
    class Hiding(nn.Sequential):  # (walks itself its own way)
        def named_modules(self, memo=None, prefix="", remove_duplicate=True):
            yield prefix, self

    model = nn.Sequential(nn.Linear(3, 2))
    _same(model)
    model.__class__ = Hiding  # (as fully_shard and parametrizations swap classes)
    _same(model)
    assert len(named_modules(model)) == 1


def test_per_sample_grads_sees_a_module_added_and_a_parameter_frozen():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    loss = nn.CrossEntropyLoss()
    assert set(per_sample_grads(model, x, y, loss)) == {"0.weight", "0.bias", "2.weight",
                                                         "2.bias"}
    model[0].bias.requires_grad_(False)
    assert set(per_sample_grads(model, x, y, loss)) == {"0.weight", "2.weight", "2.bias"}
    model.append(nn.Linear(2, 2))
    assert set(per_sample_grads(model, x, y, loss)) == {"0.weight", "2.weight", "2.bias",
                                                         "3.weight", "3.bias"}


def test_the_walk_keeps_no_model_alive():
    model = nn.Sequential(nn.Linear(3, 2))
    model.owner = [model]  # (a cycle back to the model, as some libraries keep)
    named_parameters(model)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_a_torchscript_submodule_is_walked_at_every_call():
    model = nn.Sequential(torch.jit.script(nn.Linear(3, 2)), nn.ReLU())
    _same(model)  # (TorchScript keeps its modules in a dict of its own: no stamp)
    model.append(nn.Linear(2, 2))
    _same(model)


def test_a_torch_without_dict_version_tags_walks_at_every_call(monkeypatch):
    import persample.walk as walk

    monkeypatch.setattr(walk, "dict_version", None)
    model = nn.Sequential(nn.Linear(3, 2))
    _same(model)
    model.append(nn.Linear(2, 2))
    _same(model)


def test_picked_modules_follow_every_change_of_structure():
    from persample.walk import picked_modules

    def relus(name, m):
        return isinstance(m, nn.ReLU)

    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 2)))
    assert picked_modules(model, relus) == [model[1]]
    assert picked_modules(model, relus)[0] is model[1]  # (kept: the same answer)
    model[2][0] = nn.ReLU()  # replaced deep down
    assert [id(m) for m in picked_modules(model, relus)] == [id(model[1]), id(model[2][0])]
    model[1].__class__ = nn.Tanh  # a class swapped (as fully_shard swaps it)
    assert [id(m) for m in picked_modules(model, relus)] == [id(model[2][0])]
    model.append(nn.ReLU())
    assert len(picked_modules(model, relus)) == 2


def test_picked_modules_raise_at_every_call_and_keep_no_module_alive():
    from persample.walk import picked_modules

    def refusing(name, m):
        if isinstance(m, nn.Tanh):
            raise ValueError(f"module {name!r} is refused")
        return isinstance(m, nn.Linear)

    model = nn.Sequential(nn.Linear(3, 2), nn.Tanh())
    for _ in range(2):  # (an error is never kept as an answer)
        try:
            picked_modules(model, refusing)
        except ValueError as err:
            assert "'1'" in str(err)
        else:
            raise AssertionError("the test's error was not raised")
    model[1] = nn.ReLU()
    assert picked_modules(model, refusing) == [model[0]]
    model.owner = [model]
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_buffers_follow_every_change_and_are_restored_after_a_call():
    from persample.walk import buffers

    class Counting(nn.Module):  # (a buffer its forward writes in place)
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x):
            self.seen.add_(x.shape[0])
            return self.lin(x)

    def same(model):
        assert [id(b) for b in buffers(model)] == [id(b) for b in model.buffers()]

    torch.manual_seed(0)
    model = Counting()
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    same(model)
    per_sample_grads(model, x, y, nn.CrossEntropyLoss())
    assert model.seen.item() == 0  # (restored after the call)
    model.lin.register_buffer("scale", torch.ones(1))  # registered
    same(model)
    model.seen = torch.full((), 10.0)  # replaced by assignment: the new one is restored
    same(model)
    per_sample_grads(model, x, y, nn.CrossEntropyLoss())
    assert model.seen.item() == 10
    del model.lin.scale  # deleted
    same(model)
