"""User-level DP: each user's gradient in a step, the sum of its samples', clipped once,
against DP-SGD written by hand from the loop's per-sample gradients in float64 (users
with 1 to 5 records; the batch size equal to the number of users, and other sizes that
coincide), on every clipping kind, through both norm paths (the factors of each user's
records laid end to end, and materialised gradients summed by user)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from battery import TOL, clipped_sum_by_hand
from cases import BY_ID, build
from persample import checks, loop_per_sample_grads
from persample.dp import PrivateStep, UserPoissonSampler, make_private, private_grad
from persample.dp.microbatch import Clipped, MicroBatch

# 15 samples of 6 users with 1 to 5 records each, interleaved (not in runs)
USERS = torch.tensor([40, 7, 40, 3, 7, 40, 12, 3, 40, 90, 7, 40, 3, 55, 7])
CASES = ["mlp", "linear-seq", "simple-cnn", "embedding-linear-ce", "tied-embedding-output",
         "conv-called-twice", "transformer-encoder-layer", "layernorm-last-dim"]


def _user_grads(grads: dict, users: torch.Tensor) -> dict:
    """Each user's gradient, the sum of its samples' ``{name: (U, ...)}``."""
    _, inverse = torch.unique(users, return_inverse=True)
    count = int(inverse.max()) + 1
    return {k: torch.zeros(count, *g.shape[1:]).index_add_(0, inverse, g)
            for k, g in grads.items()}


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _setup(case_id: str, n: int):
    c = BY_ID[case_id]
    model, inputs, targets = build(c, n)
    loss_fn = c["loss_fn"]("mean")
    return model, inputs, targets, loss_fn, loop_per_sample_grads(model, inputs, targets,
                                                                  loss_fn)


def _kind(kind: str, user_grads: dict) -> dict:
    names = list(user_grads)
    norms = sum(g.flatten(1).pow(2).sum(1) for g in user_grads.values()).sqrt()
    if kind == "flat":
        return dict(max_grad_norm=float(norms.median()))
    if kind == "per-layer":
        return dict(max_grad_norm=float(norms.median()), per_layer=True)
    if kind == "groups":
        groups = [names[0::2], names[1::2]] if len(names) > 1 else [names]
        bounds = [float(sum(user_grads[n].flatten(1).pow(2).sum(1) for n in g).sqrt().median())
                  for g in groups]
        return dict(max_grad_norm=bounds, param_groups=groups)
    return dict(max_grad_norm="automatic")


@pytest.mark.parametrize("kind", ["flat", "per-layer", "groups", "automatic"])
@pytest.mark.parametrize("case_id", CASES)
def test_user_level_clipping_matches_by_hand(case_id, kind):
    model, inputs, targets, loss_fn, grads = _setup(case_id, len(USERS))
    per_user = _user_grads(grads, USERS)
    options = _kind(kind, per_user)
    count = len(per_user[next(iter(per_user))])  # 6 users
    want = clipped_sum_by_hand(per_user, options["max_grad_norm"],
                               per_layer=options.get("per_layer", False),
                               param_groups=options.get("param_groups"), divisor=count)
    by_sample = clipped_sum_by_hand(grads, options["max_grad_norm"],
                                    per_layer=options.get("per_layer", False),
                                    param_groups=options.get("param_groups"), divisor=count)
    assert any(not torch.allclose(want[k], by_sample[k]) for k in want)  # users matter
    got = private_grad(model, inputs, targets, loss_fn, noise_multiplier=0.0,
                       user_ids=USERS, **options)
    user_norms = sum(g.flatten(1).pow(2).sum(1) for g in per_user.values()).sqrt()
    _, inverse = torch.unique(USERS, return_inverse=True)
    torch.testing.assert_close(got.norms, user_norms[inverse], **TOL)
    assert got.losses.shape == (len(USERS),)
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, want[name], **TOL, msg=name)


@pytest.mark.parametrize("users", [
    torch.arange(6),  # one record each: the per-sample step
    torch.tensor([1, 1, 1, 1, 1, 1]),  # one user of 6 records (B = 6, U = 1)
    torch.tensor([0, 1, 2, 0, 1, 2]),  # B = 6 samples of 3 users, 3 = the input width
])
def test_user_sizes_that_coincide(users):
    model, inputs, targets, loss_fn, grads = _setup("mlp", 6)
    per_user = _user_grads(grads, users)
    want = clipped_sum_by_hand(per_user, 0.01, divisor=len(per_user["0.weight"]))
    private_grad(model, inputs, targets, loss_fn, max_grad_norm=0.01, noise_multiplier=0.0,
                 user_ids=users)
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, want[name], **TOL, msg=name)


class Wide(nn.Module):
    """A lookup and wide linear maps: their users' norms come from factors."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc, self.out = nn.Embedding(500, 64), nn.Linear(64, 256), nn.Linear(256, 3)

    def forward(self, ids):  # (b, 2)
        return self.out(torch.tanh(self.fc(self.emb(ids).sum(1))))


@pytest.mark.parametrize("model_of", ["wide", "conv"])
def test_both_norm_paths(model_of):
    """Wide linear maps and a lookup take the factors of each user's records laid end to
    end; a small conv net its materialised gradients summed by user. Both exact."""
    torch.manual_seed(0)
    if model_of == "wide":
        model = Wide().double()
        inputs, targets = torch.randint(0, 500, (15, 2)), torch.randint(0, 3, (15,))
        loss_fn = nn.CrossEntropyLoss()
    else:
        model, inputs, targets, loss_fn, _ = _setup("simple-cnn", 15)
    grads = loop_per_sample_grads(model, inputs, targets, loss_fn)
    per_user = _user_grads(grads, USERS)
    batch, _, params = checks.validate_call(model, inputs, targets, loss_fn, "auto", None,
                                            None)
    clipped = Clipped.measure(MicroBatch(model, batch, targets, loss_fn, params, USERS))
    ghosted = set().union(*clipped.ghosted.values()) if clipped.ghosted else set()
    names = {id(p): n for n, p in params.items()}
    if model_of == "wide":
        assert {names[pid] for pid in ghosted} == {"emb.weight", "fc.weight"}
        assert id(params["out.weight"]) in clipped.materialised  # 3 rows: cheaper to form
    else:  # the convolutions' gradients formed and summed by user
        convs = {id(p) for p in params.values() if p.dim() == 4}
        assert convs and convs <= set(clipped.materialised) and not convs & ghosted
    for name, p in params.items():
        torch.testing.assert_close(clipped.squared[id(p)],
                                   per_user[name].flatten(1).pow(2).sum(1), **TOL, msg=name)
    want = clipped_sum_by_hand(per_user, 0.05, divisor=6)
    private_grad(model, inputs, targets, loss_fn, max_grad_norm=0.05, noise_multiplier=0.0,
                 user_ids=USERS)
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, want[name], **TOL, msg=name)


def test_private_step_keeps_a_users_records_together(snapshot):
    model, inputs, targets, loss_fn, grads = _setup("simple-cnn", len(USERS))
    per_user = _user_grads(grads, USERS)
    step = PrivateStep(model, loss_fn, max_grad_norm=0.05, noise_multiplier=0.0,
                       expected_batch_size=6)
    first = torch.isin(USERS, torch.tensor([40, 3]))  # two users in the first micro-batch
    step.accumulate(inputs[first], targets[first], user_ids=USERS[first])
    sums = {k: t.clone() for k, t in step.sums.items()}
    with pytest.raises(ValueError, match="user 3 was already accumulated in this step"):
        step.accumulate(inputs[~first | (USERS == 3)], targets[~first | (USERS == 3)],
                        user_ids=USERS[~first | (USERS == 3)])
    assert all(torch.equal(step.sums[k], t) for k, t in sums.items())  # nothing added
    step.accumulate(inputs[~first], targets[~first], user_ids=USERS[~first])
    step.release()
    want = clipped_sum_by_hand(per_user, 0.05, divisor=6)
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, want[name], **TOL, msg=name)
    assert step.users == set()  # a new step: every user may come again


@pytest.mark.parametrize(("bad", "match"), [
    (torch.zeros(14, dtype=torch.long), r"user_ids must be a \(15,\) integer tensor"),
    (torch.zeros(15), r"got \(15,\) torch.float"),
    ([0] * 15, r"got list"),
])
def test_bad_user_ids_are_named(bad, match, snapshot):
    model, inputs, targets, loss_fn, _ = _setup("mlp", 15)
    state = snapshot(model)
    with pytest.raises(ValueError, match=match):
        private_grad(model, inputs, targets, loss_fn, max_grad_norm=1.0, noise_multiplier=0.0,
                     user_ids=bad)
    state.assert_unchanged()


def _records():
    """200 records of up to 40 users (ids that are not 0..39)."""
    g = torch.Generator().manual_seed(3)
    users = torch.randint(0, 40, (200,), generator=g) * 11 + 5  # ids that are not 0..39
    return (torch.randn(200, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (200,), generator=g), users)


def test_make_private_samples_users_and_clips_them():
    """User-level make_private: users Poisson-sampled (q over the 40 users), at most
    ``records_per_user`` records each, a user whole in one physical batch, the step's
    p.grad the by-hand clip of each user's summed gradient, epsilon per user."""
    x, y, users = _records()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    opt = torch.optim.SGD(net.parameters(), lr=0.0)  # p.grad inspected after release
    private = make_private(net, opt, TensorDataset(x, y), nn.CrossEntropyLoss(),
                           noise_multiplier=0.0, epochs=1, max_grad_norm=0.05,
                           expected_batch_size=8, physical_batch_size=12, user_ids=users,
                           records_per_user=3, generator=torch.Generator().manual_seed(1))
    assert private.sample_rate == 8 / len(users.unique()) and private.steps_per_epoch == 5
    assert isinstance(private.sampler, UserPoissonSampler)
    seen_users = []
    for logical in private.batches():
        step_records, step_users = [], []
        for xb, yb in logical:
            u = private.users
            assert len(u) == len(yb) <= 12
            assert all((users == v).sum() >= (u == v).sum() for v in u.unique())
            assert all((u == v).sum() <= 3 for v in u.unique())
            assert not set(u.tolist()) & set(step_users)  # a user in one physical batch
            private.accumulate(xb, yb)
            step_records.append((xb, yb, u))
            step_users += u.tolist()
        opt_grads = _release_and_read(private, net)
        if step_records:
            xs = torch.cat([r[0] for r in step_records])
            ys = torch.cat([r[1] for r in step_records])
            us = torch.cat([r[2] for r in step_records])
            per = _user_grads(loop_per_sample_grads(net, xs, ys, nn.CrossEntropyLoss()), us)
            want = clipped_sum_by_hand(per, 0.05, divisor=8)
            for name, g in opt_grads.items():
                torch.testing.assert_close(g, want[name], **TOL, msg=name)
        seen_users.append(len(set(step_users)))
    assert private.step.accountant.steps == 5 and len(set(seen_users)) > 1


def _release_and_read(private, net) -> dict:
    """release() without the optimizer's zero_grad: p.grad as the step wrote it."""
    private.step.release()
    return {n: p.grad.clone() for n, p in net.named_parameters()}


def test_make_private_reads_a_user_id_field_and_refuses_what_cannot_work():
    x, y, users = _records()
    rows = [{"x": x[i], "y": y[i], "user_id": int(users[i])} for i in range(200)]
    net = nn.Linear(4, 3).double()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    private = make_private(net, opt, rows, nn.CrossEntropyLoss(), noise_multiplier=1.0,
                           epochs=1, max_grad_norm=1.0, expected_batch_size=8,
                           physical_batch_size=16, user_ids="user_id")
    assert torch.equal(private.sampler.user_of, users)
    for logical in private.batches():
        for batch in logical:
            private.accumulate(batch["x"], batch["y"])
            assert torch.equal(batch["user_id"], private.users)
        private.release()
    base = dict(noise_multiplier=1.0, epochs=1, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="pass expected_batch_size: the number of users"):
        make_private(net, opt, TensorDataset(x, y), nn.CrossEntropyLoss(), user_ids=users,
                     **base)
    with pytest.raises(ValueError, match=r"brings \d+ records to a step, more than "
                                         r"physical_batch_size \(2\)"):
        make_private(net, opt, TensorDataset(x, y), nn.CrossEntropyLoss(), user_ids=users,
                     expected_batch_size=8, physical_batch_size=2, **base)
    with pytest.raises(ValueError, match=r"at most the number of users \(\d+\)"):
        make_private(net, opt, TensorDataset(x, y), nn.CrossEntropyLoss(), user_ids=users,
                     expected_batch_size=100, **base)
    with pytest.raises(ValueError, match="names a field, but the dataset's samples"):
        make_private(net, opt, TensorDataset(x, y), nn.CrossEntropyLoss(), user_ids="user_id",
                     expected_batch_size=8, **base)
    with pytest.raises(ValueError, match=r"one integer user per record, \(200,\)"):
        make_private(net, opt, TensorDataset(x, y), nn.CrossEntropyLoss(),
                     user_ids=users[:10], expected_batch_size=8, **base)


def test_user_level_accounting_against_dp_accounting():
    """The accountant of a user-level run counts its steps at the users' sample rate:
    dp_accounting's RDP of the same Poisson-sampled Gaussian, composed directly."""
    import dp_accounting
    from dp_accounting import rdp

    x, y, users = _records()
    net = nn.Linear(4, 3).double()
    private = make_private(net, torch.optim.SGD(net.parameters(), lr=0.1),
                           TensorDataset(x, y), nn.CrossEntropyLoss(), noise_multiplier=1.3,
                           epochs=2, max_grad_norm=1.0, expected_batch_size=8,
                           physical_batch_size=16, user_ids=users,
                           generator=torch.Generator().manual_seed(0))
    for _ in range(private.epochs):
        for logical in private.batches():
            for xb, yb in logical:
                private.accumulate(xb, yb)
            private.release()
    q = 8 / len(users.unique())
    steps = 2 * private.steps_per_epoch
    accountant = rdp.RdpAccountant()
    accountant.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.3)), steps))
    assert private.sample_rate == q and private.step.accountant.steps == steps
    assert private.epsilon(1e-5) == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)
