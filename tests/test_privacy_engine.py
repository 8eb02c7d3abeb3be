"""persample's ``PrivacyEngine``: an Opacus script's loop (``loss.backward();
optimizer.step()``) unchanged but for the import, against ``PrivateStep`` by hand on
the batches the loop saw, in float64: ``"hooks"`` (the output's gradient, a linear
loss whose per-sample gradient is each sample's own) and ``"ghost"`` (the criterion
evaluated per sample), dropout replayed with the forward's own masks."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import zoo
from persample.dp import PrivacyEngine, PrivateStep, epsilon
from spawned import ranks_of

N, B = 120, 20  # 6 Poisson batches an epoch, of 20 expected


def _data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g))


class Net(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.fc, self.drop, self.out = nn.Linear(6, 16), nn.Dropout(dropout), nn.Linear(16, 3)

    def forward(self, x):
        return self.out(self.drop(torch.tanh(self.fc(x))))


def _twin(dropout: float):
    torch.manual_seed(0)
    return Net(dropout)


def _opacus_loop(model, optimizer, loader, criterion, steps: int):
    """The loop of Opacus's tutorials, as it is; the batches and RNG states it saw."""
    seen = []
    for k, (x, y) in enumerate(loader):
        if k == steps:
            break
        seen.append((x, y, torch.get_rng_state()))
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
    return seen


def _by_hand(seen, dropout: float, c: float, expected: int = B) -> nn.Module:
    """PrivateStep (sigma 0) on the same batches, each forward from the state the loop's
    forward started from: the same dropout masks."""
    return _by_hand_in_parts([[batch] for batch in seen], dropout, c, expected)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("wrap_model", [True, False])
def test_the_opacus_loop_is_private_step_by_hand(mode, dropout, reduction, wrap_model):
    """With ``wrap_model=False`` the user's own module runs, its forwards (and dropout
    masks) kept by hooks."""
    model = _twin(dropout)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    criterion = nn.CrossEntropyLoss(reduction=reduction)
    engine = PrivacyEngine()
    returned = engine.make_private(module=model, optimizer=optimizer,
                                   data_loader=DataLoader(_data(), batch_size=B, shuffle=True),
                                   noise_multiplier=0.0, max_grad_norm=0.3,
                                   criterion=criterion, loss_reduction=reduction,
                                   grad_sample_mode=mode, wrap_model=wrap_model)
    if mode == "ghost":
        private_model, private_opt, criterion, loader = returned
    else:
        private_model, private_opt, loader = returned
    if not wrap_model:
        private_model = model  # (the hooks' object only cleans up)
    assert private_opt.expected_batch_size == B
    seen = _opacus_loop(private_model, private_opt, loader, criterion, steps=3)
    assert len({len(y) for _, y, _ in seen}) > 1  # Poisson: sizes vary
    want = _by_hand(seen, dropout, 0.3, B)
    for (name, p), q in zip(model.named_parameters(), want.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=name)
    moved = _twin(dropout)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), moved.parameters()))
    q = 1 / len(loader)
    assert engine.get_epsilon(1e-5) == math.inf  # sigma 0
    assert engine.accountant.steps == 3 and q == pytest.approx(B / N)


def test_the_accounting_and_the_target_epsilon():
    model = _twin(0.0)
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(), batch_size=B), target_epsilon=2.0, target_delta=1e-5,
        epochs=2, max_grad_norm=1.0)
    for _ in range(2):
        for x, y in loader:
            optimizer.zero_grad()
            nn.CrossEntropyLoss()(model(x), y).backward()
            optimizer.step()
    assert engine.accountant.steps == 12
    sigma = optimizer.noise_multiplier
    assert engine.accountant.mechanism() == "prv"  # Opacus's default
    assert engine.get_epsilon(1e-5) == pytest.approx(epsilon(sigma, B / N, 12, 1e-5, "prv"))
    assert engine.accountant.get_epsilon(delta=1e-5) == engine.get_epsilon(1e-5)  # Opacus's
    assert 1.9 < engine.get_epsilon(1e-5) <= 2.0


def test_forwards_without_backward_and_refusals():
    base = _twin(0.0)
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=base, optimizer=torch.optim.SGD(base.parameters(), lr=0.0),
        data_loader=DataLoader(_data(), batch_size=B), noise_multiplier=0.0, max_grad_norm=1e3)
    assert not base._forward_hooks and not base._forward_pre_hooks  # nothing on the model
    assert list(model.state_dict()) == ["_module." + k for k in base.state_dict()]
    x, y = _data().tensors
    optimizer.zero_grad()
    model(x[:7])  # a forward without backward (an evaluation with grad on): not a step's
    nn.CrossEntropyLoss()(model(x[:5]), y[:5]).backward()  # (loss_reduction "mean")
    optimizer.step()  # C large, sigma 0: the 5 samples' summed gradient over B
    twin = _twin(0.0)
    want = torch.autograd.grad(nn.CrossEntropyLoss(reduction="sum")(twin(x[:5]), y[:5]),
                               list(twin.parameters()))
    for p, g in zip(base.parameters(), want):
        torch.testing.assert_close(p.grad, g / B, rtol=1e-10, atol=1e-12)
    optimizer.zero_grad()
    for _ in range(2):
        nn.CrossEntropyLoss()(model(x[:5]), y[:5]).backward()
    with pytest.raises(ValueError, match="2 forwards and backwards since the last step"):
        optimizer.step()
    for options, match in [(dict(clipping="adaptive"), "clipping='adaptive'"),
                           (dict(target_unclipped_quantile=0.5), "target_unclipped_quantile"),
                           (dict(loss_reduction="none"), "loss_reduction='none'")]:
        with pytest.raises(ValueError, match=match):
            PrivacyEngine().make_private(
                module=base, optimizer=torch.optim.SGD(base.parameters(), lr=0.1),
                data_loader=DataLoader(_data(), batch_size=B), noise_multiplier=1.0,
                max_grad_norm=1.0, **options)
    with pytest.raises(ValueError, match="Module parameters are different than optimizer "):
        PrivacyEngine().make_private(module=base,
                                     optimizer=torch.optim.SGD(_twin(0.0).parameters(), lr=0.1),
                                     data_loader=DataLoader(_data(), batch_size=B),
                                     noise_multiplier=1.0, max_grad_norm=1.0)
    assert all(torch.equal(p, q) for p, q in zip(base.parameters(), _twin(0.0).parameters()))


class DictNet(nn.Module):
    """Returns a dict of which the loss reads one entry."""

    def __init__(self):
        super().__init__()
        self.net = Net()

    def forward(self, x):
        logits = self.net(x)
        return {"logits": logits, "unused": logits.square()}


def test_a_dict_output_of_which_the_loss_reads_one_entry():
    torch.manual_seed(0)
    model = DictNet()
    engine = PrivacyEngine()
    private, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(_data(), batch_size=B), noise_multiplier=0.0,
        max_grad_norm=0.3)
    seen = []
    for k, (x, y) in enumerate(loader):
        if k == 2:
            break
        seen.append((x, y, torch.get_rng_state()))
        optimizer.zero_grad()
        nn.CrossEntropyLoss()(private(x)["logits"], y).backward()
        optimizer.step()
    want = _by_hand(seen, 0.0, 0.3, B)
    for p, q in zip(model.net.parameters(), want.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def _opacus_steps(opacus, seen) -> nn.Module:
    """Opacus's own PrivacyEngine (sigma 0) on the physical batches ``seen``, grouped by
    logical batch: its optimizer told which of them end their logical batch, as its
    BatchMemoryManager tells it."""
    theirs = _twin(0.0)
    with pytest.warns(UserWarning):  # (Opacus warns about its secure RNG)
        o_model, o_opt, _ = opacus.PrivacyEngine().make_private(
            module=theirs, optimizer=torch.optim.SGD(theirs.parameters(), lr=0.5),
            data_loader=DataLoader(_data(), batch_size=B), noise_multiplier=0.0,
            max_grad_norm=0.3)
    for logical in seen:
        for k, (x, y, _) in enumerate(logical):
            o_opt.signal_skip_step(do_skip=k < len(logical) - 1)
            o_opt.zero_grad()
            nn.CrossEntropyLoss()(o_model(x), y).backward()
            o_opt.step()
    return theirs


@pytest.mark.parametrize("loop", ["plain", "bmm"])
def test_the_same_steps_as_opacus_itself(loop):
    """Opacus's own PrivacyEngine on the batches persample's loader gave (sigma 0), its
    optimizer told which physical batches end their logical batch as its
    BatchMemoryManager tells it: the same weights."""
    opacus = zoo.require("opacus")
    model = _twin(0.0)
    engine = PrivacyEngine()
    private, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(_data(), batch_size=B), noise_multiplier=0.0,
        max_grad_norm=0.3)
    seen = _bmm_loop(engine, private, optimizer, loader, nn.CrossEntropyLoss(), 3,
                     SIZE if loop == "bmm" else None)
    theirs = _opacus_steps(opacus, seen)
    for p, q in zip(model.parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-11)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), _twin(0.0).parameters()))


def test_ghost_refuses_a_loss_that_mixes_samples():
    from persample.errors import LossNotPerSampleError

    def mixing(out, y):  # each sample's term depends on the batch's mean
        return nn.functional.cross_entropy(out - out.mean(0), y)

    model = _twin(0.0)
    engine = PrivacyEngine()
    model, optimizer, criterion, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(), batch_size=B), noise_multiplier=1.0,
        max_grad_norm=1.0, criterion=mixing, grad_sample_mode="ghost")
    x, y = _data().tensors
    loss = criterion(model(x[:10]), y[:10])
    with pytest.raises(LossNotPerSampleError, match="mixes samples"):
        with pytest.warns(UserWarning):
            loss.backward()


SIZE = 8  # physical batches of at most 8: the 20 expected take 3


def _bmm_loop(engine, model, optimizer, loader, criterion, logical_steps: int,
              size: int | None = SIZE):
    """The loop of Opacus's tutorials, as it is, under ``BatchMemoryManager`` (physical
    batches of at most ``size``; ``None``: without it); the physical batches and RNG
    states it saw, grouped by the logical batch each step ended (the accountant counts
    one step per logical batch)."""
    from contextlib import nullcontext

    from persample.dp import BatchMemoryManager

    seen, current = [], []
    manager = nullcontext(loader) if size is None else BatchMemoryManager(
        data_loader=loader, max_physical_batch_size=size, optimizer=optimizer)
    with manager as physical:
        for x, y in physical:
            current.append((x, y, torch.get_rng_state()))
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            if engine.accountant.steps > len(seen):
                seen, current = seen + [current], []
            if len(seen) == logical_steps:
                break
    assert not optimizer.skips  # left clean
    return seen


def _by_hand_in_parts(seen, dropout: float, c: float, expected: int = B) -> nn.Module:
    """PrivateStep (sigma 0) accumulating each logical batch's physical batches, each
    forward from the state the loop's started from, then one release and step."""
    model = _twin(dropout)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    step = PrivateStep(model, nn.CrossEntropyLoss(), max_grad_norm=c, noise_multiplier=0.0,
                       expected_batch_size=expected)
    for logical in seen:
        for x, y, state in logical:
            with torch.random.fork_rng():
                torch.set_rng_state(state)
                step.accumulate(x, y)
        step.release()
        opt.step()
        opt.zero_grad()
    return model


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_batch_memory_manager_is_private_step_over_physical_batches(mode):
    model = _twin(0.3)
    model.train()
    engine = PrivacyEngine()
    returned = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(_data(), batch_size=B, shuffle=True), noise_multiplier=0.0,
        max_grad_norm=0.3, criterion=nn.CrossEntropyLoss(), grad_sample_mode=mode)
    private_model, private_opt, *criterion, loader = returned
    criterion = criterion[0] if criterion else nn.CrossEntropyLoss()
    seen = _bmm_loop(engine, private_model, private_opt, loader, criterion, logical_steps=3)
    sizes = [[len(y) for _, y, _ in logical] for logical in seen]
    assert all(1 <= len(s) and max(s) <= SIZE and max(s) - min(s) <= 1 for s in sizes), sizes
    assert any(len(s) > 1 for s in sizes)  # the logical batches were split
    assert engine.accountant.steps == 3
    want = _by_hand_in_parts(seen, 0.3, 0.3)
    for (name, p), q in zip(model.named_parameters(), want.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=name)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), _twin(0.3).parameters()))


def test_batch_memory_manager_refuses_what_make_private_did_not_return():
    from persample.dp import BatchMemoryManager

    model = _twin(0.0)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    _, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=plain, data_loader=DataLoader(_data(), batch_size=B),
        noise_multiplier=1.0, max_grad_norm=1.0)
    for kwargs, match in [(dict(optimizer=plain), "takes the optimizer"),
                          (dict(data_loader=DataLoader(_data(), batch_sampler=[[0, 1], [2]])),
                           "takes the data loader"),
                          (dict(max_physical_batch_size=0), "must be an int >= 1")]:
        options = dict(data_loader=loader, max_physical_batch_size=4, optimizer=optimizer)
        with pytest.raises(ValueError, match=match):
            BatchMemoryManager(**{**options, **kwargs})


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> list[dict]:
    """What each of two gloo processes saw (spawned once for the tests below)."""
    import privacy_engine_workers as workers

    return ranks_of(workers.worker, tmp_path_factory.mktemp("engine"), 2)


@pytest.mark.slow  # several processes
@pytest.mark.parametrize("how, loop", [("ddp", "plain"), ("ddp", "bmm"), ("fsdp", "plain"),
                                       ("fsdp", "bmm"), ("fsdp", "ghost")])
def test_two_processes_are_one_step_over_both_ranks_batches(saved, how, loop):
    """Two gloo processes, the model wrapped in DDP or sharded with FSDP2, each rank's own
    dropout masks: every rank ends with the same weights, those of PrivateStep
    accumulating both ranks' batches of each logical batch (sigma 0); the ranks' batches
    are disjoint parts of one Poisson sample. With BatchMemoryManager, physical batches
    of at most 4, as many on each rank; "ghost": Opacus's ghost_fsdp criterion."""
    import privacy_engine_workers as workers

    assert all("secure_mode with several processes" in s["secure"] for s in saved)
    ranks = [s[how, loop] for s in saved]
    counts = [[len(logical) for logical in rank["seen"]] for rank in ranks]
    assert counts[0] == counts[1]  # the ranks stepped alike
    assert (max(counts[0]) > 1) == (loop == "bmm") and ranks[0]["sharded"] == (how == "fsdp")
    for p, q in zip(ranks[0]["weights"], ranks[1]["weights"]):
        assert torch.equal(p, q)
    merged = [ranks[0]["seen"][k] + ranks[1]["seen"][k] for k in range(workers.STEPS)]
    x_all = _data().tensors[0]
    for logical in merged:
        assert all(len(x) <= (workers.SIZE if loop == "bmm" else N) for x, _, _ in logical)
        rows = [int((x_all == row).all(1).nonzero()) for x, _, _ in logical for row in x]
        assert len(rows) == len(set(rows))  # disjoint: one sample split between ranks
    want = _by_hand_in_parts(merged, 0.3, 0.3, workers.B)
    for p, q in zip(ranks[0]["weights"], want.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
    assert any(not torch.equal(p, q) for p, q in zip(want.parameters(), _twin(0.3).parameters()))


# ---------------------------------------------------------------------------
# what an Opacus script reads besides the loop: attributes, checkpoints, the
# accountant, ModuleValidator


def _made(engine: PrivacyEngine, model: nn.Module, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return engine.make_private(module=model, optimizer=opt,
                               data_loader=DataLoader(_data(), batch_size=B),
                               noise_multiplier=1.0, max_grad_norm=1.0, **kw)


def test_the_wrapped_model_passes_attributes_and_loads_either_checkpoint():
    base = _twin(0.0)
    model, _, _ = _made(PrivacyEngine(), base)
    assert model.fc is base.fc and model.out is base.out  # as GradSampleModule's
    assert model.forward.__self__ is model  # (its own methods stay its own)
    with pytest.raises(AttributeError, match="nothing"):
        _ = model.nothing
    other = _twin(0.0)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    model.load_state_dict(other.state_dict())  # the user's module's names
    assert torch.equal(base.fc.weight, other.fc.weight)
    model.load_state_dict({k: v - 1 for k, v in model.state_dict().items()})  # "_module."
    assert torch.allclose(base.fc.weight, other.fc.weight - 1)


def test_the_accountant_reads_as_opacus_accountants_do():
    from opacus.accountants import RDPAccountant

    engine, theirs = PrivacyEngine(accountant="rdp"), RDPAccountant()
    model, opt, loader = _made(engine, _twin(0.0))
    for x, y in loader:
        opt.zero_grad()
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()
        theirs.step(noise_multiplier=1.0, sample_rate=1 / len(loader))
    assert engine.accountant.mechanism() == theirs.mechanism() == "rdp"
    assert len(engine.accountant) == len(theirs) == 1
    assert [tuple(run) for run in engine.accountant.history] == theirs.history
    # (their RDP orders are not dp_accounting's: a few parts in 1e5)
    assert math.isclose(engine.get_epsilon(1e-5), theirs.get_epsilon(1e-5), rel_tol=1e-4)


def test_a_checkpoint_brings_back_the_model_the_accountant_and_the_noise(tmp_path):
    torch.manual_seed(1)
    engine = PrivacyEngine()
    model, opt, loader = _made(engine, _twin(0.0))
    batches = [next(iter(loader)) for _ in range(3)]

    def step(x, y):
        opt.zero_grad()
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()

    for x, y in batches[:2]:
        step(x, y)
    engine.save_checkpoint(path=tmp_path / "ckpt.pt", module=model, optimizer=opt,
                           checkpoint_dict={"epoch": 7})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    step(*batches[2])
    after = {k: v.clone() for k, v in model.state_dict().items()}
    steps = engine.accountant.steps
    got = engine.load_checkpoint(path=tmp_path / "ckpt.pt", module=model, optimizer=opt)
    assert got["epoch"] == 7 and engine.accountant.steps == steps - 1
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    step(*batches[2])  # the same noise drawn again: the generator's state came back
    assert all(torch.equal(after[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="call make_private first"):
        PrivacyEngine().save_checkpoint(path=tmp_path / "x.pt", module=model)


def test_an_opacus_checkpoint_loads_its_accountant(tmp_path):
    engine = PrivacyEngine()
    model, _, _ = _made(engine, _twin(0.0))
    torch.save({"module_state_dict": model.state_dict(),
                "privacy_accountant_state_dict": {"history": [(1.0, 1 / 6, 12)],
                                                  "mechanism": "rdp"}}, tmp_path / "o.pt")
    engine.load_checkpoint(path=tmp_path / "o.pt", module=model)
    assert engine.accountant.steps == 12
    assert math.isclose(engine.get_epsilon(1e-5), epsilon(1.0, 1 / 6, 12, 1e-5), rel_tol=1e-9)


class _WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(1, 48, 3), nn.BatchNorm2d(48)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(48 * 4, 3), nn.BatchNorm1d(3))

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))))


def test_batch_norm_is_refused_at_make_private_and_fixed_as_opacus_fixes_it():
    from opacus.validators import ModuleValidator as Theirs

    from persample.dp import ModuleValidator

    model = _WithBatchNorm()
    data = TensorDataset(torch.randn(8, 1, 4, 6), torch.randint(0, 3, (8,)))
    with pytest.raises(ValueError, match=r"module 'bn' \(BatchNorm2d\).*ModuleValidator.fix"):
        PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=4), noise_multiplier=1.0,
            max_grad_norm=1.0)
    errors = ModuleValidator.validate(model)
    assert [str(e).split(" mixes")[0] for e in errors] == ["module 'bn' (BatchNorm2d)",
                                                          "module 'head.2' (BatchNorm1d)"]
    with pytest.raises(Exception, match="module 'bn'"):
        ModuleValidator.validate(model, strict=True)
    fixed, theirs = ModuleValidator.fix(model), Theirs.fix(model)
    assert isinstance(model.bn, nn.BatchNorm2d)  # the model itself unchanged
    for name in ("bn", "head.2"):
        ours_m, their_m = fixed.get_submodule(name), theirs.get_submodule(name)
        assert type(ours_m) is type(their_m) is nn.GroupNorm
        assert (ours_m.num_groups, ours_m.num_channels) == (their_m.num_groups,
                                                            their_m.num_channels)
    assert ModuleValidator.is_valid(fixed) and not ModuleValidator.is_valid(model)
    assert ModuleValidator.fix(model, num_groups=3).bn.num_groups == 3
    assert type(PrivacyEngine.get_compatible_module(model).bn) is nn.GroupNorm  # Opacus's name
    PrivacyEngine().make_private(
        module=fixed, optimizer=torch.optim.SGD(fixed.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0)


def test_the_default_accountant_gives_opacus_sigma_for_a_target():
    """Opacus's default accountant (PRV): the noise ``make_private_with_epsilon`` picks for
    a target is Opacus's (within the calibrations' tolerances); without Opacus, PLD."""
    import opacus

    sigmas = []
    for engine in (PrivacyEngine(), opacus.PrivacyEngine()):
        model = _twin(0.0)
        _, optimizer, _ = engine.make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_data(), batch_size=B), target_epsilon=3.0,
            target_delta=1e-5, epochs=5, max_grad_norm=1.0)
        sigmas.append(optimizer.noise_multiplier)
    assert sigmas[0] == pytest.approx(sigmas[1], rel=0.01), sigmas


def test_without_opacus_the_default_accountant_is_pld(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "opacus" else real(name, *a))
    with pytest.warns(UserWarning, match="Opacus is not installed"):
        engine = PrivacyEngine()
    _made(engine, _twin(0.0))
    assert engine.accountant.mechanism() == "pld"


def test_the_loader_is_a_dp_data_loader_as_opacus_makes_it():
    from persample.dp import DPDataLoader

    _, _, loader = _made(PrivacyEngine(), _twin(0.0))
    assert isinstance(loader, DPDataLoader) and loader.sample_rate == pytest.approx(B / N)
    mine = DPDataLoader.from_data_loader(DataLoader(_data(), batch_size=B),
                                         generator=torch.Generator().manual_seed(0))
    assert isinstance(mine, DPDataLoader) and len(mine) == N // B
    sizes = [len(y) for _ in range(20) for _, y in mine]
    assert len(set(sizes)) > 3 and abs(sum(sizes) / len(sizes) - B) < 2  # Poisson, mean B
    empty = DPDataLoader(_data(), sample_rate=1e-9)  # every batch empty, collated as such
    x, y = next(iter(empty))
    assert x.shape == (0, 6) and y.shape == (0,)
    with pytest.raises(ValueError, match="rand_on_empty"):
        DPDataLoader(_data(), sample_rate=0.1, rand_on_empty=True)
    with pytest.raises(ValueError, match="batch_size"):
        DPDataLoader(_data(), sample_rate=0.1, batch_size=4)


class SeqFirst(nn.Module):
    """A sequence-first text model (inputs ``(T, B)``, torch's attention with
    ``batch_first=False``), its output ``(B, classes)``."""

    def __init__(self):
        super().__init__()
        self.emb, self.attn = nn.Embedding(30, 8), nn.MultiheadAttention(8, 2)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):  # (T, B)
        h = self.emb(x)
        h, _ = self.attn(h, h, h)  # (T, B, 8)
        return self.fc(h.mean(0))  # (B, 3)


def _seq_first_loop_sums(model: nn.Module, x, y, c: float) -> dict:
    """The clipped sum by hand: each sample's gradient from its own column of ``x``."""
    from battery import clipped_sum_by_hand

    params = dict(model.named_parameters())
    rows = [torch.autograd.grad(nn.CrossEntropyLoss()(model(x[:, i:i + 1]), y[i:i + 1]),
                                list(params.values())) for i in range(x.shape[1])]
    grads = {n: torch.stack([r[k] for r in rows]) for k, n in enumerate(params)}
    return clipped_sum_by_hand(grads, c)


@pytest.mark.parametrize("wrap_model", [True, False])
def test_batch_first_false_and_wrap_model_false_are_the_loop_over_samples(wrap_model):
    T = b = 5  # the sequence as long as the batch: a guess of the batch dim would show
    torch.manual_seed(0)
    base, twin = SeqFirst(), SeqFirst()
    twin.load_state_dict(base.state_dict())
    data = [(torch.randint(0, 30, (T,)), torch.randint(0, 3, ())) for _ in range(4 * b)]

    def collate(batch):  # Opacus's test's: the batch in dim 1
        return torch.stack([s for s, _ in batch]).T, torch.stack([t for _, t in batch])

    opt = torch.optim.SGD(base.parameters(), lr=0.0)
    got, opt, loader = PrivacyEngine().make_private(
        module=base, optimizer=opt, data_loader=DataLoader(data, batch_size=b,
                                                           collate_fn=collate),
        noise_multiplier=0.0, max_grad_norm=0.05, batch_first=False, wrap_model=wrap_model,
        poisson_sampling=True)
    model = got if wrap_model else base
    assert (not wrap_model) == bool(base._forward_hooks)  # hooks only without wrapping
    x, y = next(iter(loader))
    assert x.shape[0] == T and x.shape[1] == len(y)
    opt.zero_grad()
    nn.CrossEntropyLoss()(model(x), y).backward()
    opt.step()
    want = _seq_first_loop_sums(twin, x, y, 0.05)
    for (name, p), w in zip(base.named_parameters(), want.values()):
        torch.testing.assert_close(p.summed_grad, w, rtol=1e-8, atol=1e-12, msg=name)
        torch.testing.assert_close(p.grad, w / opt.expected_batch_size, rtol=1e-8,
                                   atol=1e-12, msg=name)
    if not wrap_model:
        got.cleanup()
        assert not base._forward_hooks and not base._forward_pre_hooks
    with pytest.raises(ValueError, match=r"output has 3 rows but its input has 5 samples "
                                         r"in dim 1 \(batch_first=False\)"):
        class Wrong(nn.Module):  # the output's batch not in dim 0
            def __init__(self):
                super().__init__()
                self.net = SeqFirst()

            def forward(self, x):
                return self.net(x).T

        wrong = Wrong()
        w_model, w_opt, _ = PrivacyEngine().make_private(
            module=wrong, optimizer=torch.optim.SGD(wrong.parameters(), lr=0.0),
            data_loader=DataLoader(data, batch_size=b, collate_fn=collate),
            noise_multiplier=0.0, max_grad_norm=1.0, batch_first=False)
        w_opt.zero_grad()
        w_model(torch.randint(0, 30, (T, b))).sum().backward()  # 5 samples, 3 classes
        w_opt.step()


def test_poisson_sampling_false_keeps_the_loader_and_warns():
    base = _twin(0.0)
    plain = DataLoader(_data(), batch_size=B)
    with pytest.warns(UserWarning, match="poisson_sampling=False: the loader's batches are "
                                         "used as they are"):
        model, opt, loader = PrivacyEngine().make_private(
            module=base, optimizer=torch.optim.SGD(base.parameters(), lr=0.1),
            data_loader=plain, noise_multiplier=1.0, max_grad_norm=1.0,
            poisson_sampling=False)
    assert loader is plain and opt.expected_batch_size == B


def test_summed_grad_goes_on_over_skipped_steps_and_zero_grad_forgets_it():
    base = _twin(0.0)
    model, opt, _ = _made(PrivacyEngine(), base)
    x, y = _data().tensors
    sums = []
    for part in (slice(0, 3), slice(3, 7)):
        opt.signal_skip_step()
        opt.zero_grad()
        nn.CrossEntropyLoss()(model(x[part]), y[part]).backward()
        before = base.fc.weight.detach().clone()
        assert opt.step() is None  # skipped: no noise, no optimizer step
        assert torch.equal(base.fc.weight, before)
        sums.append(base.fc.weight.summed_grad.clone())
    by_hand = PrivateStep(_twin(0.0), nn.CrossEntropyLoss(), max_grad_norm=1.0,
                          noise_multiplier=0.0, expected_batch_size=B)
    by_hand.accumulate(x[:7], y[:7])  # the 7 samples' clipped sum, in one go
    torch.testing.assert_close(sums[-1], by_hand.sums["fc.weight"], rtol=1e-10, atol=1e-12)
    assert not torch.equal(sums[0], sums[1])
    opt.zero_grad()  # the last step was skipped: the sums go on
    assert torch.equal(base.fc.weight.summed_grad, sums[-1])
    nn.CrossEntropyLoss()(model(x[7:9]), y[7:9]).backward()
    opt.step()
    assert base.fc.weight.grad is not None
    opt.zero_grad()
    assert base.fc.weight.summed_grad is None


def test_schedules_set_sigma_and_the_clipping_norm_and_each_step_is_accounted_as_it_ran():
    from persample.dp.schedulers import StepGradClip, StepNoise

    base = _twin(0.0)
    engine = PrivacyEngine(accountant="rdp")
    model, opt, loader = _made(engine, base)
    noise, clip = StepNoise(opt, step_size=1, gamma=2.0), StepGradClip(opt, step_size=1,
                                                                      gamma=0.5)
    x, y = _data().tensors
    for k in range(2):
        opt.zero_grad()
        nn.CrossEntropyLoss()(model(x[:1]), y[:1]).backward()
        opt.step()
        sums = torch.cat([p.summed_grad.flatten() for p in base.parameters()])
        assert float(sums.norm()) == pytest.approx(0.5 ** k)  # one sample, clipped to C
        noise.step()
        clip.step()
    assert [run[0] for run in engine.accountant.history] == [1.0, 2.0]
    assert (opt.noise_multiplier, opt.max_grad_norm) == (4.0, 0.25)
    spent = engine.get_epsilon(1e-5)  # one step at sigma 1, one at 2: between the two
    assert epsilon(2.0, 1 / 6, 2, 1e-5, "rdp") < spent < epsilon(1.0, 1 / 6, 2, 1e-5, "rdp")
    opt.zero_grad()
    nn.CrossEntropyLoss()(model(x[:1]), y[:1]).backward()
    opt.signal_skip_step()
    opt.step()  # accumulated, not released
    with pytest.raises(ValueError, match="this step has accumulated samples"):
        opt.max_grad_norm = 1.0
    with pytest.raises(ValueError, match="must be >= 0"):
        opt.noise_multiplier = -1.0


def test_make_private_raises_opacus_error_for_batch_norm_and_fixes_to_instance_norm(caplog):
    from persample.dp import ModuleValidator
    from persample.errors import MixesSamplesError, UnsupportedModuleError

    model = _WithBatchNorm()
    data = TensorDataset(torch.randn(8, 1, 4, 6), torch.randint(0, 3, (8,)))
    with pytest.raises(UnsupportedModuleError, match=r"module 'bn' \(BatchNorm2d\)") as err:
        PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=4), noise_multiplier=1.0,
            max_grad_norm=1.0)
    assert isinstance(err.value, MixesSamplesError) and isinstance(err.value, ValueError)
    with caplog.at_level("INFO", logger="persample.dp.validator"):
        fixed = ModuleValidator.fix(model, replace_bn_with_in=True)
    assert type(fixed.bn) is nn.InstanceNorm2d and fixed.bn.affine and fixed.bn.eps == 1e-5
    assert type(fixed.get_submodule("head.2")) is nn.InstanceNorm1d
    assert [r.getMessage().split(" :")[0] for r in caplog.records] == [
        "Replaced sub_module bn", "Replaced sub_module head.2"]
    with pytest.raises(ValueError, match="exclusive"):
        ModuleValidator.fix(model, replace_bn_with_in=True, num_groups=4)
