"""``make_private``: DP-SGD set up from a privacy target in one call, the model and the
optimizer left as they are."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from persample.dp import PoissonBatchSampler, PrivateStep, make_private, noise_multiplier_for

N, B = 400, 40  # q = 0.1: 10 logical batches an epoch


def _setup(seed: int = 0, **kw):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(N, 4, generator=g), torch.randint(0, 3, (N,), generator=g))
    opts = dict(target_epsilon=3.0, target_delta=1e-5, epochs=2, max_grad_norm=1.0,
                expected_batch_size=B, physical_batch_size=16,
                generator=torch.Generator().manual_seed(seed)) | kw
    return net, opt, make_private(net, opt, data, nn.CrossEntropyLoss(), **opts)


def _train(private) -> list[list[int]]:
    sizes = []
    for _ in range(private.epochs):
        for logical in private.batches():
            parts = [len(y) for x, y in logical for _ in [private.accumulate(x, y)]]
            sizes.append(parts)
            private.release()
    return sizes


def test_the_target_is_spent_over_the_planned_steps():
    net, opt, private = _setup()
    assert private.sample_rate == B / N and private.steps_per_epoch == 10
    assert private.noise_multiplier == pytest.approx(
        noise_multiplier_for(3.0, 1e-5, 0.1, 20), rel=1e-9)
    assert isinstance(private.step, PrivateStep)
    sizes = _train(private)
    assert private.step.accountant.steps == len(sizes) == 20
    assert 0.98 * 3.0 <= private.epsilon(1e-5) <= 3.0
    # physical batches of at most 16, a logical batch whole (Poisson: sizes vary)
    assert all(all(0 < s <= 16 for s in parts) for parts in sizes)
    assert all(all(s == 16 for s in parts[:-1]) for parts in sizes)
    assert len({sum(parts) for parts in sizes}) > 1


def test_the_model_and_the_optimizer_are_not_wrapped():
    net, opt, private = _setup()
    params = list(net.parameters())
    _train(private)
    assert type(net) is nn.Sequential and type(opt) is torch.optim.SGD
    assert list(net.parameters()) == params and opt.param_groups[0]["params"] == params
    assert not net._forward_hooks and all(not m._forward_hooks for m in net.modules())
    assert all(p.grad is None for p in params)  # release zeroes them after the step


def test_a_seed_reproduces_the_run():
    runs = []
    for _ in range(2):
        net, _, private = _setup(seed=5)
        _train(private)
        runs.append([p.detach().clone() for p in net.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    other, _, private = _setup(seed=6)
    _train(private)
    assert not torch.equal(runs[0][0], other[0].weight)


@pytest.mark.parametrize(("bad", "match"), [
    (dict(expected_batch_size=N + 1), "at most the number of samples"),
    (dict(physical_batch_size=0), "physical_batch_size must be an int >= 1"),
    (dict(epochs=0), "epochs must be an int >= 1"),
    (dict(target_epsilon=-1.0), "epsilon"),
])
def test_bad_plans_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        _setup(**bad)


# ---------------------------------------------------------------------------
# a DataLoader, as Opacus users pass it


def _data():
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(N, 4, generator=g), torch.randint(0, 3, (N,), generator=g))


class AsDict:
    """A user's collate function, recording the process each batch was collated in."""

    def __call__(self, samples):
        info = torch.utils.data.get_worker_info()
        x, y = torch.utils.data.default_collate(samples)
        return {"x": x, "y": y, "worker": -1 if info is None else info.id}


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _run(private, unpack) -> list[list[int]]:
    sizes = []
    for _ in range(private.epochs):
        for logical in private.batches():
            parts = []
            for batch in logical:
                x, y = unpack(batch)
                losses, norms = private.accumulate(x, y)
                assert losses.shape == norms.shape == y.shape
                parts.append(len(y))
            sizes.append(parts)
            private.release()
    return sizes


def test_a_dataloader_is_taken_as_opacus_takes_it():
    """The loader's dataset (N = 400 samples, not its 10 batches), its batch size as the
    expected logical batch, its collate function and workers; the same run as the
    dataset with the same seed."""
    from torch.utils.data import DataLoader

    opts = dict(target_epsilon=3.0, target_delta=1e-5, epochs=2, max_grad_norm=1.0,
                physical_batch_size=16)
    net = _net()
    loader = DataLoader(_data(), batch_size=B, shuffle=True, drop_last=True,
                        collate_fn=AsDict(), num_workers=2)
    private = make_private(net, torch.optim.SGD(net.parameters(), lr=0.1), loader,
                           nn.CrossEntropyLoss(), generator=torch.Generator().manual_seed(3),
                           **opts)
    assert len(loader) == N // B and private.sample_rate == B / N
    assert private.steps_per_epoch == 10 and private.dataset is loader.dataset
    kept = private.loader
    assert kept.num_workers == 2 and isinstance(kept.collate_fn, AsDict)
    workers = set()

    def unpack(batch):
        workers.add(batch["worker"])
        return batch["x"], batch["y"]

    sizes = _run(private, unpack)
    assert workers <= {0, 1} and workers  # collated in the workers
    assert all(all(0 < s <= 16 for s in parts) for parts in sizes)
    assert private.step.accountant.steps == 20

    same = _net()  # the dataset with the same seed and expected batch size: the same run
    twin = make_private(same, torch.optim.SGD(same.parameters(), lr=0.1), _data(),
                        nn.CrossEntropyLoss(), expected_batch_size=B,
                        generator=torch.Generator().manual_seed(3), **opts)
    assert _run(twin, tuple) == sizes
    for a, b in zip(net.parameters(), same.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_an_unfinished_logical_batch_is_skipped_whole():
    net = _net()
    private = make_private(net, torch.optim.SGD(net.parameters(), lr=0.1), _data(),
                           nn.CrossEntropyLoss(), noise_multiplier=1.0, epochs=1,
                           max_grad_norm=1.0, expected_batch_size=B, physical_batch_size=8,
                           generator=torch.Generator().manual_seed(0))
    drawn = list(PoissonBatchSampler(N, B / N, 10, _batch_generator(0)))
    got = []
    for k, logical in enumerate(private.batches()):
        first = next(logical, None)  # one physical batch of each logical one only
        rest = None if k % 2 else list(logical)
        got.append((first, rest))
    for (first, rest), want in zip(got, drawn):
        x, y = first
        assert torch.equal(y, _data().tensors[1][want[:8]])
        if rest is not None:
            assert sum(len(b[1]) for b in rest) + len(y) == len(want)


def _batch_generator(seed: int) -> torch.Generator:
    """make_private's batch generator: seeded with one draw ``s`` of the generator it was
    given (the noise's seed is ``s + 1``)."""
    s = int(torch.randint(2**62, (1,), generator=torch.Generator().manual_seed(seed)))
    return torch.Generator().manual_seed(s)


def test_a_noise_multiplier_instead_of_a_target():
    net = _net()
    private = make_private(net, torch.optim.SGD(net.parameters(), lr=0.1), _data(),
                           nn.CrossEntropyLoss(), noise_multiplier=1.3, epochs=1,
                           max_grad_norm=1.0, expected_batch_size=B)
    assert private.noise_multiplier == private.step.noise_multiplier == 1.3
    assert private.physical_batch_size == B  # default: the expected batch size
    _run(private, tuple)
    from persample.dp import epsilon
    assert private.epsilon(1e-5) == pytest.approx(epsilon(1.3, B / N, 10, 1e-5), rel=1e-9)


def test_dataloader_refusals_are_named():
    from torch.utils.data import DataLoader, IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            yield from zip(torch.randn(10, 4), torch.zeros(10, dtype=torch.long))

    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    base = dict(epochs=1, max_grad_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match=r"(?s)Stream has no len\(\).*map-style dataset"):
        make_private(net, opt, DataLoader(Stream(), batch_size=4), nn.CrossEntropyLoss(),
                     **base)
    sampler = torch.utils.data.BatchSampler(range(N), 10, False)
    with pytest.raises(ValueError, match="pass expected_batch_size.*no batch_size"):
        make_private(net, opt, DataLoader(_data(), batch_sampler=sampler),
                     nn.CrossEntropyLoss(), **base)
    with pytest.raises(ValueError, match="pass expected_batch_size.*a dataset"):
        make_private(net, opt, _data(), nn.CrossEntropyLoss(), **base)
    with pytest.raises(ValueError, match="either target_epsilon.*not both"):
        make_private(net, opt, _data(), nn.CrossEntropyLoss(), expected_batch_size=B,
                     target_epsilon=1.0, target_delta=1e-5, **base)
    with pytest.raises(ValueError, match="not neither"):
        make_private(net, opt, _data(), nn.CrossEntropyLoss(), expected_batch_size=B,
                     epochs=1, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="target_epsilon needs target_delta"):
        make_private(net, opt, _data(), nn.CrossEntropyLoss(), expected_batch_size=B,
                     epochs=1, max_grad_norm=1.0, target_epsilon=1.0)


def test_the_loader_alone_draws_a_new_epoch_each_time():
    net = _net()
    private = make_private(net, torch.optim.SGD(net.parameters(), lr=0.1), _data(),
                           nn.CrossEntropyLoss(), noise_multiplier=1.0, epochs=1,
                           max_grad_norm=1.0, expected_batch_size=B,
                           generator=torch.Generator().manual_seed(0))
    first = [y.tolist() for _, y in private.loader]
    second = [y.tolist() for _, y in private.loader]
    assert first != second and all(0 < len(y) <= B for y in first + second)
