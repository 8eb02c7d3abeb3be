"""Results persample allocates: contiguous, in touched memory reused across calls
(``persample.memory``), never overwritten while the caller holds them."""

import pytest
import torch
from torch import nn

import persample
import persample.dp
from persample import memory


def _net(width: int = 600) -> nn.Module:  # 600 x 600 weights: over memory.MIN_BYTES at B=4
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, 3))


def _data(n: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def test_flat_result_is_contiguous_when_p_is_not_a_multiple_of_16():
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))  # P = 67
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    flat = persample.per_sample_grads(net, x, y, nn.CrossEntropyLoss(), flat=True)
    assert flat.shape == (5, 67) and flat.is_contiguous()
    assert flat.view(-1).shape == (335,)
    jac = persample.param_jacobian(net, x, flat=True)
    assert jac.shape == (5, 3, 67) and jac.is_contiguous()


def test_dict_results_are_contiguous_and_exact():
    net = _net()
    x, y = _data()
    got = persample.per_sample_grads(net, x, y, nn.CrossEntropyLoss())
    want = persample.loop_per_sample_grads(net, x, y, nn.CrossEntropyLoss())
    for name, g in got.items():
        assert g.is_contiguous(), name
        torch.testing.assert_close(g, want[name], rtol=1e-10, atol=1e-12)


def test_a_dropped_result_block_is_reused():
    net, (x, y) = _net(), _data()
    first = persample.per_sample_grads(net, x, y, nn.CrossEntropyLoss(), flat=True)
    ptr = first.data_ptr()
    del first
    second = persample.per_sample_grads(net, x, y, nn.CrossEntropyLoss(), flat=True)
    assert second.data_ptr() == ptr


def test_a_held_result_is_never_overwritten():
    net = _net()
    loss = nn.CrossEntropyLoss()
    results, copies = [], []
    for seed in range(4):  # more calls than the pool keeps free blocks
        x, y = _data(seed=seed)
        for flat in (False, True):
            r = persample.per_sample_grads(net, x, y, loss, flat=flat)
            results.append(r)
            copies.append({k: v.clone() for k, v in r.items()} if isinstance(r, dict)
                          else r.clone())
    for r, c in zip(results, copies):
        if isinstance(r, dict):
            assert all(torch.equal(r[k], c[k]) for k in r)
        else:
            assert torch.equal(r, c)
    ptrs = {r.data_ptr() if not isinstance(r, dict) else next(iter(r.values())).data_ptr()
            for r in results}
    assert len(ptrs) == len(results)  # every live result has its own memory


def test_one_kept_view_keeps_the_whole_block():
    net, (x, y) = _net(), _data()
    kept = persample.per_sample_grads(net, x, y, nn.CrossEntropyLoss())["2.weight"]
    value = kept.clone()
    for seed in range(3):
        persample.per_sample_grads(net, *_data(seed=seed + 1), nn.CrossEntropyLoss())
    assert torch.equal(kept, value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_result_empty_dtypes(dtype):
    buf = memory.result_empty(1 << 19, dtype, torch.device("cpu"))
    assert buf.dtype == dtype and buf.shape == (1 << 19,) and buf.is_contiguous()
    assert buf.data_ptr() % 64 == 0


def test_empty_cache_frees_the_pool():
    net, (x, y) = _net(), _data()
    persample.per_sample_grads(net, x, y, nn.CrossEntropyLoss())
    assert memory._POOL.free
    persample.empty_cache()
    assert not memory._POOL.free


def test_no_capture_outlives_its_call_without_the_cyclic_gc():
    """The capture (and the autograd graph it holds) is freed by reference counting when
    a call returns: a reference cycle would keep every micro-batch's graph alive until the
    cyclic GC runs (gigabytes in a DP fine-tuning loop)."""
    import gc

    from persample.capture import Capture

    net, (x, y) = _net(60), _data()
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            persample.per_sample_grads(net, x, y, nn.CrossEntropyLoss())
            persample.per_sample_grad_norms(net, x, y, nn.CrossEntropyLoss())
        alive = sum(isinstance(o, Capture) for o in gc.get_objects())
    finally:
        gc.enable()
    assert alive == 0


def test_the_dp_backward_frees_activations_as_a_plain_backward_does():
    """After the DP step's backward, activations no rule reads are gone while the step
    still holds its capture: no retained autograd graph (the clipped sums of ops without
    a weighted-sum rule replay the op), no module call keeping its output, no hook on a
    frozen module (GPT-2's DP step: 1.59x -> 1.17x a plain step's peak memory)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from persample import checks
    from persample.batch import located
    from persample.capture import Capture
    from persample.engine import loss_backprops
    from persample.engine.weighted import keeps_graph

    torch.manual_seed(0)
    frozen, block_tanh = nn.Linear(5, 16), nn.Tanh()
    frozen.requires_grad_(False)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.act = nn.Linear(16, 16), block_tanh

        def forward(self, x):  # the call's output, which tanh keeps for its backward
            return self.act(self.fc(x))

    class Double(nn.Module):
        def forward(self, x):
            return x * 2

    net = nn.Sequential(frozen, nn.Tanh(), Block(), Double(), nn.Linear(16, 3))
    seen = {}
    for name, module in (("frozen", frozen), ("tanh", block_tanh)):
        module.register_forward_hook(
            lambda m, a, out, name=name: seen.__setitem__(
                name, StorageWeakRef(out.untyped_storage())))
    x, y = _data()
    batch, _, params = checks.validate_call(net, x, y, nn.CrossEntropyLoss(), "auto", None,
                                            None)
    watched = {id(p): p for p in params.values()}
    with Capture(net, watched, batch.n, located(batch), batch.shared) as capture:
        out = batch.call(net)  # a frozen module's output is not kept by the capture
    assert capture.calls and seen["frozen"].expired() and not seen["tanh"].expired()
    del out, capture
    cap = loss_backprops(net, batch, y, nn.CrossEntropyLoss(), watched,
                         retain_graph=keeps_graph)
    assert cap.grads and seen["frozen"].expired() and seen["tanh"].expired()
    del cap
    _, norms = persample.dp.private_grad(net, x, y, nn.CrossEntropyLoss(), max_grad_norm=0.01,
                                      noise_multiplier=0.0)  # and the step is still exact
    want = persample.loop_per_sample_grads(net, x, y, nn.CrossEntropyLoss())
    flat = torch.cat([g.flatten(1) for g in want.values()], 1)
    torch.testing.assert_close(norms, flat.norm(dim=1), rtol=1e-10, atol=1e-12)
