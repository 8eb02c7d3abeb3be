"""The memory of a DP step: ``private_grad`` holds one buffer of the parameters' size (the
noise drawn into it after the backward, the clipped sums added to it, then ``p.grad``);
``PrivateStep`` makes its sums after the first micro-batch's backward, a later micro-batch
adds a temporary only, and the release adds the noise in place (the numbers
``gaussian_like`` draws) and makes the sums ``p.grad``. Counted in bytes handed out by
the DP buffers' allocator and in the peak of live tensor storage."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import persample
from fsdp_workers import LiveBytes
from persample.dp import PrivateStep, microbatch, noise, private_grad
from persample.dp.noise import BLOCK, add_gaussian, gaussian_like, pooled_like

WIDTH, LAYERS, B = 256, 8, 4


def _net() -> nn.Module:
    """Equal layers, so that no one parameter is a large part of the whole."""
    torch.manual_seed(0)
    layers = [m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 3))


def _data(seed: int, n: int = B) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, WIDTH, generator=g), torch.randint(0, 3, (n,), generator=g)


def _bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture(autouse=True)
def _fresh_pool():
    """No free block of persample's result memory left by another test: the pool hands
    out a free block up to twice the size asked for, which the peak would count."""
    persample.empty_cache()


@pytest.fixture
def handed_out(monkeypatch) -> list[int]:
    """The bytes of every buffer the DP step asks persample's result memory for."""
    sizes: list[int] = []
    real = noise.result_empty

    def counted(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        out = real(numel, dtype, device)
        sizes.append(out.numel() * out.element_size())
        return out

    monkeypatch.setattr(noise, "result_empty", counted)
    return sizes


def _storages(model: nn.Module) -> set[int]:
    return {p.grad.untyped_storage().data_ptr() for p in model.parameters()}


def test_private_grad_holds_one_buffer_that_becomes_p_grad(handed_out):
    model = _net()
    private_grad(model, *_data(0), nn.CrossEntropyLoss(), max_grad_norm=0.1,
                 noise_multiplier=1.0, generator=torch.Generator().manual_seed(0))
    assert handed_out == [_bytes(model)]  # one buffer, the parameters' size
    assert len(_storages(model)) == 1  # every p.grad views it


def test_private_grad_peak_is_the_parameters_and_one_buffer():
    model = _net()
    x, y = _data(0)
    size = _bytes(model)
    private_grad(model, x, y, nn.CrossEntropyLoss(), max_grad_norm=0.1,
                 noise_multiplier=1.0)  # the first call of this plan: certified
    live = LiveBytes()
    with live:
        private_grad(model, x, y, nn.CrossEntropyLoss(), max_grad_norm=0.1,
                     noise_multiplier=1.0, generator=torch.Generator().manual_seed(0))
    # the parameters, the noised sums, and small things (one layer is 1/9 of the whole):
    # a second buffer of the parameters' size would give 3x
    assert live.peak < 2.3 * size, live.peak / size


def test_private_step_release_adds_no_buffer(handed_out):
    model = _net()
    step = PrivateStep(model, nn.CrossEntropyLoss(), max_grad_norm=0.1, noise_multiplier=1.0,
                       expected_batch_size=3 * B, generator=torch.Generator().manual_seed(0))
    size = _bytes(model)
    step.accumulate(*_data(0))
    assert handed_out == [size]  # the step's sums, made after the backward
    for seed in (1, 2):  # each later micro-batch: a temporary, added once complete
        step.accumulate(*_data(seed))
    assert handed_out == [size] * 3
    kept = {t.untyped_storage().data_ptr() for t in step.sums.values()}
    live = LiveBytes()
    with live:
        step.release()
    assert handed_out == [size] * 3  # the noise added in place: nothing new
    assert _storages(model) == kept  # p.grad is the sums' memory
    assert live.peak < 2.3 * size, live.peak / size  # parameters, sums, one block of noise


def test_the_release_adds_the_numbers_gaussian_like_draws():
    """``(sums + noise) / B'`` with the noise of ``gaussian_like`` from the same generator
    state, bit for bit (the in-place addition is the same floating-point sum)."""
    model = _net()
    step = PrivateStep(model, nn.CrossEntropyLoss(), max_grad_norm=0.1, noise_multiplier=1.3,
                       expected_batch_size=7, generator=torch.Generator().manual_seed(5))
    step.accumulate(*_data(0))
    step.accumulate(*_data(1))
    sums = {k: t.clone() for k, t in step.sums.items()}
    drawn = gaussian_like(list(model.parameters()), 1.3 * 0.1,
                          torch.Generator().manual_seed(5), accumulate=True)
    step.release()
    for (name, p), z in zip(model.named_parameters(), drawn):
        assert torch.equal(p.grad, (z + sums[name]) / 7), name


@pytest.mark.parametrize("threads", [1, 2])
def test_add_gaussian_adds_gaussian_like_in_blocks(threads):
    """Several blocks per parameter, drawn in parallel or not, at any offset of a pooled
    buffer: the same numbers as ``gaussian_like``, and the generator advanced alike."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        params = [nn.Parameter(torch.zeros(s)) for s in [(3,), (BLOCK + 17,), (2, BLOCK + 1)]]
        want = gaussian_like(params, 0.7, torch.Generator().manual_seed(1), accumulate=True)
        sums = pooled_like(params, lambda b: b.uniform_(), accumulate=True)
        base = [t.clone() for t in sums]
        gen = torch.Generator().manual_seed(1)
        add_gaussian(sums, 0.7, gen)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(t, z + b) for t, z, b in zip(sums, want, base))
    again = torch.Generator().manual_seed(1)
    gaussian_like(params, 0.7, again)
    assert torch.equal(gen.get_state(), again.get_state())


@pytest.mark.parametrize("first", [True, False], ids=["first", "later"])
def test_a_micro_batch_failing_after_its_sums_were_made_adds_nothing(first, monkeypatch):
    model = _net()
    step = PrivateStep(model, nn.CrossEntropyLoss(), max_grad_norm=0.1, noise_multiplier=0.0,
                       expected_batch_size=8)
    if not first:
        step.accumulate(*_data(0))
    before = None if first else {k: t.clone() for k, t in step.sums.items()}

    def broken(self, into, group):  # a failure after part of the sums was added
        for t in into.values():
            t.add_(1.0)
        raise RuntimeError("injected")

    monkeypatch.setattr(microbatch.Clipped, "add_group", broken)
    with pytest.raises(RuntimeError, match="injected"):
        step.accumulate(*_data(1))
    if first:
        assert step.sums is None and step.samples == 0
    else:
        assert all(torch.equal(step.sums[k], before[k]) for k in before)
        assert step.samples == B
