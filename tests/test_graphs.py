"""``persample.graphed``: a call replayed on each new batch gives the function's own
result for that batch, and a changed model or a new kind of batch is captured again,
never replayed stale. Here, with no GPU, a CUDA graph's contract stands in for it (its
replay runs the captured call again on the tensors the capture read, writing the tensors
it returned); ``tests/test_cuda.py`` replays real graphs against the loop."""

import pytest
import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

import persample
from persample import graphed, graphs


class _Graph:
    """What a CUDA graph does, without a GPU: each replay runs the captured call again
    (the same input tensors, the parameters' memory) into the outputs of the capture."""

    def __init__(self, call, out):
        self.call, self.out = call, out

    def replay(self):
        for mine, got in zip(tree_flatten(self.out)[0], tree_flatten(self.call())[0]):
            if isinstance(mine, Tensor):
                mine.copy_(got)


@pytest.fixture
def as_on_a_gpu(monkeypatch):
    def capture(call, device, warmup):
        for _ in range(warmup):
            call()
        out = call()
        return _Graph(call, out), out

    monkeypatch.setattr(graphs, "_device", lambda model, leaves: torch.device("cpu"))
    monkeypatch.setattr(graphs, "_cuda_capture", capture)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Dropout(0.0), nn.Linear(7, 3))


def _batch(n=6):
    return torch.randn(n, 5), torch.randint(0, 3, (n,))


def _assert_same(got, want):
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-12, atol=1e-14)


def test_each_call_gives_the_functions_result_for_its_batch(as_on_a_gpu):
    net, loss_fn = _net(), nn.CrossEntropyLoss()
    step = graphed(persample.per_sample_grads, net, loss_fn=loss_fn)
    kept = []
    for _ in range(3):
        x, y = _batch()
        with torch.no_grad():  # an optimizer's step, in place
            for p in net.parameters():
                p.add_(torch.randn_like(p), alpha=0.1)
        got = step(x, y)
        _assert_same(got, persample.loop_per_sample_grads(net, x, y, loss_fn))
        kept.append(got)
    assert step.captures == 1
    assert kept[0]["0.weight"].data_ptr() != kept[1]["0.weight"].data_ptr()  # cloned


def test_without_clone_the_results_are_the_graphs_own_overwritten(as_on_a_gpu):
    net, loss_fn = _net(), nn.CrossEntropyLoss()
    step = graphed(persample.per_sample_grads, net, loss_fn=loss_fn, clone=False)
    first = step(*_batch())
    x, y = _batch()
    second = step(x, y)
    assert all(first[k] is second[k] for k in first)
    _assert_same(second, persample.loop_per_sample_grads(net, x, y, loss_fn))


@pytest.mark.parametrize("change", ["new parameter", "eval", "frozen", "submodule"])
def test_a_changed_model_is_captured_again(change, as_on_a_gpu):
    net, loss_fn = _net(), nn.CrossEntropyLoss()
    step = graphed(persample.per_sample_grads, net, loss_fn=loss_fn)
    step(*_batch())
    if change == "new parameter":
        net[0].weight = nn.Parameter(torch.randn(7, 5))
    elif change == "eval":
        net.eval()
    elif change == "frozen":
        net[0].bias.requires_grad_(False)
    else:
        net[1] = nn.Sigmoid()
    x, y = _batch()
    got = step(x, y)
    assert step.captures == 2
    _assert_same(got, persample.loop_per_sample_grads(net, x, y, loss_fn))


def test_each_kind_of_batch_has_its_graph(as_on_a_gpu):
    net, loss_fn = _net(), nn.CrossEntropyLoss()
    step = graphed(persample.per_sample_grads, net, loss_fn=loss_fn)
    for n in (6, 4, 6, 4):  # (a last, smaller batch of an epoch, and back)
        x, y = _batch(n)
        _assert_same(step(x, y), persample.loop_per_sample_grads(net, x, y, loss_fn))
    assert step.captures == 2
    other = nn.MSELoss()  # another loss, by position: another kind of call
    x = torch.randn(6, 5)
    targets = torch.randn(6, 3)
    step2 = graphed(persample.per_sample_grads, net)
    step2(x, targets, loss_fn)
    _assert_same(step2(x, targets, other), persample.loop_per_sample_grads(net, x, targets,
                                                                           other))
    assert step2.captures == 2


def test_the_least_recently_used_kinds_of_batch_are_dropped(as_on_a_gpu):
    net, loss_fn = _net(), nn.CrossEntropyLoss()
    step = graphed(persample.per_sample_grads, net, loss_fn=loss_fn, warmup=1)
    sizes = list(range(2, 3 + graphs.KEPT))  # one kind more than are kept
    for n in sizes:
        step(*_batch(n))
    assert step.captures == len(sizes)
    x, y = _batch(sizes[-1])  # kept: replayed
    _assert_same(step(x, y), persample.loop_per_sample_grads(net, x, y, loss_fn))
    assert step.captures == len(sizes)
    x, y = _batch(sizes[0])  # the first kind, dropped: captured again
    _assert_same(step(x, y), persample.loop_per_sample_grads(net, x, y, loss_fn))
    assert step.captures == len(sizes) + 1
    step.clear()
    step(x, y)
    assert step.captures == len(sizes) + 2


def test_a_call_under_autocast_has_its_own_graph(as_on_a_gpu):
    net, loss_fn = _net().float(), nn.CrossEntropyLoss()
    step = graphed(persample.per_sample_grads, net, loss_fn=loss_fn)
    x, y = _batch()
    x = x.float()
    plain = step(x, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = step(x, y)
        want = persample.per_sample_grads(net, x, y, loss_fn)
    assert step.captures == 2
    _assert_same(low, want)
    again = step(x, y)  # back outside: the first graph, float32 throughout
    assert step.captures == 2
    torch.testing.assert_close(again, plain, rtol=0, atol=0)
    assert not all(torch.equal(low[k], plain[k]) for k in plain)


def test_a_call_that_cannot_be_captured_is_named(as_on_a_gpu, monkeypatch):
    """The capture's failure names the function, torch's error as its cause; an error of
    the call itself (run eagerly first) comes as it is."""
    net, loss_fn = _net(), nn.CrossEntropyLoss()
    step = graphed(persample.per_sample_grads, net, loss_fn=loss_fn)
    with pytest.raises(RuntimeError, match="mat1 and mat2") as err:
        step(torch.randn(6, 4), torch.randint(0, 3, (6,)))  # a wrong width: the model's
    assert "graphed" not in str(err.value)  # own error

    def fails(call, device, warmup):
        try:
            raise RuntimeError("operation not permitted when stream is capturing")
        except RuntimeError as torch_error:
            raise graphs._Uncapturable() from torch_error

    monkeypatch.setattr(graphs, "_cuda_capture", fails)
    with pytest.raises(RuntimeError, match="graphed: per_sample_grads on this model cannot "
                                           "be captured") as err:
        step(*_batch())
    assert "not permitted when stream is capturing" in str(err.value.__cause__)
    assert step.captures == 0


def test_a_dp_step_is_refused_before_anything_runs():
    from persample.dp import private_grad

    net = _net()
    with pytest.raises(ValueError, match="private_grad is a DP step"):
        graphed(private_grad, net, loss_fn=nn.CrossEntropyLoss(), max_grad_norm=1.0,
                noise_multiplier=1.0)
    assert all(p.grad is None for p in net.parameters())


def test_warmup_must_be_positive():
    with pytest.raises(ValueError, match="warmup=0"):
        graphed(persample.per_sample_grads, _net(), warmup=0)


def test_without_a_gpu_a_call_is_the_functions_own():
    net, loss_fn = _net(), nn.CrossEntropyLoss()
    step = graphed(persample.per_sample_grads, net, loss_fn=loss_fn, clone=False)
    x, y = _batch()
    first = step(x, y)
    _assert_same(first, persample.loop_per_sample_grads(net, x, y, loss_fn))
    second = step(*_batch())
    assert step.captures == 0 and first["0.weight"] is not second["0.weight"]


@pytest.mark.parametrize("name", ["per_sample_grad_norms", "param_jacobian"])
def test_other_functions_replayed(name, as_on_a_gpu):
    """A tensor result (the norms ``(n,)``) or a Jacobian's ``{name: (n, 3, *shape)}``, with the
    batch alone as the call's argument where the function takes no targets."""
    net, loss_fn = _net(), nn.CrossEntropyLoss()
    if name == "per_sample_grad_norms":
        step = graphed(persample.per_sample_grad_norms, net, loss_fn=loss_fn)
        want = lambda x, y: persample.per_sample_grad_norms(net, x, y, loss_fn)  # noqa: E731
        call = lambda x, y: step(x, y)  # noqa: E731
    else:
        step = graphed(persample.param_jacobian, net)
        want = lambda x, y: persample.loop_param_jacobian(net, x)  # noqa: E731
        call = lambda x, y: step(x)  # noqa: E731
    for _ in range(3):
        x, y = _batch()
        with torch.no_grad():
            net[0].weight.add_(torch.randn_like(net[0].weight), alpha=0.1)
        torch.testing.assert_close(call(x, y), want(x, y), rtol=1e-10, atol=1e-12)
    assert step.captures == 1
