"""A cached call's rules replayed as the ATen ops they ran (``persample.engine.replay``).

Each model is called several times (the rules run, then record, then are replayed) and
every call is compared with the loop in float64; a replayed call runs no rule, and
anything that changes what the rules would do (shapes, a frozen parameter, a parameter
replaced, a value read) records anew or runs the rules. Batch size = sequence length =
heads where they can coincide.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from battery import assert_exact
from persample import clear_plans, loop_per_sample_grads, per_sample_grads
from persample.engine import pullback, replay

B = T = 4
E = 8


class Block(nn.Module):
    """Embedding, attention by hand, layer norm, an MLP with dropout: the rules of a
    transformer's block (linear, layer norm, embedding, a derived position table)."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.tok = nn.Embedding(11, E)
        self.pos = nn.Embedding(T, E)
        self.qkv = nn.Linear(E, 3 * E)
        self.out = nn.Linear(E, E)
        self.norm = nn.LayerNorm(E)
        self.mlp = nn.Sequential(nn.Linear(E, 2 * E), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(2 * E, E))
        self.head = nn.Linear(E, 3)

    def forward(self, ids):
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        q, k, v = self.qkv(h).view(*ids.shape, 3, B, E // B).unbind(2)
        att = torch.softmax(torch.einsum("bthd,bshd->bhts", q, k), -1)
        h = h + self.out(torch.einsum("bhts,bshd->bthd", att, v).flatten(2))
        h = h + self.mlp(self.norm(h))
        return self.head(h.mean(1))


def _mlp():
    return nn.Sequential(nn.Linear(E, B), nn.Tanh(), nn.Linear(B, B), nn.ReLU(),
                         nn.Linear(B, 3))


def _ce(out, y):
    return nn.functional.cross_entropy(out, y)


class Counts:
    """How many calls ran the rules, and how many replayed them."""

    def __init__(self, monkeypatch):
        self.rules = self.replays = 0
        rules, call = pullback._rules, replay.Replay.__call__

        def counted_rules(*args):
            self.rules += 1
            return rules(*args)

        def counted_call(kept, inputs):
            self.replays += 1
            return call(kept, inputs)

        monkeypatch.setattr(pullback, "_rules", counted_rules)
        monkeypatch.setattr(replay.Replay, "__call__", counted_call)


@pytest.fixture
def counts(monkeypatch):
    clear_plans()
    monkeypatch.setattr(replay, "ENABLED", [True])
    monkeypatch.setattr(replay, "CHECK", [False])
    return Counts(monkeypatch)


def _data(vocab: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 11, (B, T), generator=g) if vocab else torch.randn(
        B, E, dtype=torch.float64, generator=g)
    return x, torch.randint(0, 3, (B,), generator=g)


def _replayed_from_the_compiled_call(model: nn.Module, data, counts: Counts) -> None:
    """Eight calls with new values each (``data(call) -> (x, y)``: the replay reads this
    call's), each the loop's answer; from the seventh (the compiled call: its first runs
    the rules, its second records) none runs the rules."""
    for call in range(8):
        x, y = data(call)
        rules_before = counts.rules
        assert_exact(per_sample_grads(model, x, y, _ce), loop_per_sample_grads(model, x, y, _ce))
        if call >= 6:
            assert counts.rules == rules_before, "a replayed call ran the rules"
    assert counts.replays >= 2


@pytest.mark.parametrize("build", [_mlp, Block], ids=["stock-mlp", "block"])
def test_replayed_calls_agree_with_the_loop_and_run_no_rule(build, counts, compiled):
    torch.manual_seed(0)
    _replayed_from_the_compiled_call(build().double(),
                                     lambda call: _data(build is Block, seed=call), counts)


class Typed(nn.Module):
    """Token ids looked up beside a shared row of type ids expanded to the batch (BERT's
    ``token_type_ids`` buffer): the type table is a derived lookup, paired with the
    samples where its rows meet the tokens' (a decision that reads the type ids)."""

    def __init__(self):
        super().__init__()
        self.tok, self.typ = nn.Embedding(11, E), nn.Embedding(2, E)
        self.register_buffer("types", torch.zeros(T, dtype=torch.long))
        self.head = nn.Linear(E, 3)

    def forward(self, ids):
        h = self.tok(ids) + self.typ(self.types.expand(ids.shape[0], -1))
        return self.head(torch.tanh(h).mean(1))


def test_a_derived_lookup_of_shared_ids_is_replayed(counts, compiled):
    """The pairing decision of a derived op, which reads the ids' values, is kept with
    the replay and taken again at each call: the calls replay, each equal to the loop."""
    torch.manual_seed(0)
    _replayed_from_the_compiled_call(Typed().double(), lambda call: _data(True, seed=call),
                                     counts)


class Scaled(nn.Module):
    """A per-channel scale made by two ops from a parameter (PoolFormer's layer scale,
    ``scale.unsqueeze(-1).unsqueeze(-1)``), of as many channels as the batch has samples:
    the second op reads a derived tensor, so the pullback looks at its cotangents'
    values for each sample's own channel (none here: every sample reads every channel)."""

    def __init__(self):
        super().__init__()
        self.conv, self.scale = nn.Conv2d(2, B, 1), nn.Parameter(torch.rand(B) + 0.5)
        self.head = nn.Linear(B, 3)

    def forward(self, x):
        h = self.conv(x)  # (B, C = B, 3, 3)
        h = h + self.scale.unsqueeze(-1).unsqueeze(-1) * torch.tanh(h)
        return self.head(h.mean((2, 3)))


def test_a_derived_chain_with_a_dim_the_size_of_the_batch_is_replayed(counts, compiled):
    """The values read to pair a derived tensor's cotangents with the samples (they pair
    none here) are read apart from the recording: the calls replay, each the loop's."""
    def data(call: int) -> tuple:
        g = torch.Generator().manual_seed(call)
        return (torch.randn(B, 2, 3, 3, dtype=torch.float64, generator=g),
                torch.randint(0, 3, (B,), generator=g))

    torch.manual_seed(0)
    _replayed_from_the_compiled_call(Scaled().double(), data, counts)


class RowPerSample(nn.Module):
    """A table made from parameters alone, ``(B, E)``, read at rows an input names: at
    ``arange(B)`` each sample's cotangent is zero but at its own row (paired by its
    values: a form for those values alone), at another order it is not."""

    def __init__(self):
        super().__init__()
        self.table, self.head = nn.Linear(3, E), nn.Linear(E, 3)

    def forward(self, x, rows):
        states = self.table(torch.ones(B, 3, dtype=x.dtype))  # (B, E), no sample's
        return self.head(torch.tanh(x + states[rows]))


def test_cotangents_paired_by_their_values_are_not_replayed(counts, compiled):
    """Where the cotangents' values pair them with the samples, the rules are not
    recorded: a later call whose rows pair otherwise takes its own rules, the loop's
    answer."""
    torch.manual_seed(0)
    model = RowPerSample().double()
    x, y = _data(False)
    for call in range(8):
        rows = torch.arange(B) if call < 7 else torch.arange(B).flip(0)
        assert_exact(per_sample_grads(model, (x, rows), y, _ce),
                     loop_per_sample_grads(model, (x, rows), y, _ce))
    assert counts.replays == 0


def test_a_replay_whose_decision_differs_runs_the_rules(counts):
    """Where a decision a replay was recorded with comes out otherwise in a call, that
    call runs the rules (its answer still the loop's)."""
    torch.manual_seed(0)
    model = Typed().double()
    for call in range(5):
        x, y = _data(True, seed=call)
        per_sample_grads(model, x, y, _ce)
    kept = [r for _, found in replay._REPLAYS.values() for _, r in found
            if isinstance(r, replay.Replay) and r.decisions]
    assert kept
    for r in kept:  # (as if the recording call had paired the type ids otherwise)
        r.decisions = [(index, align, [None] * len(want)) for index, align, want in r.decisions]
    rules_before, replays_before = counts.rules, counts.replays
    x, y = _data(True, seed=9)
    assert_exact(per_sample_grads(model, x, y, _ce), loop_per_sample_grads(model, x, y, _ce))
    assert counts.rules == rules_before + 1 and counts.replays == replays_before


def test_dropout_replayed_against_the_forward_that_ran(counts):
    """In training mode the rules read the masks this call drew (kept by the capture);
    the replay reads them as the rules do: compared with the rules on the same call."""
    torch.manual_seed(0)
    model = Block(dropout=0.5).double().train()
    x, y = _data(True)
    for call in range(8):
        torch.manual_seed(call)
        got = per_sample_grads(model, x, y, _ce)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(replay, "ENABLED", [False])
            torch.manual_seed(call)
            want = per_sample_grads(model, x, y, _ce)
        assert_exact(got, want, rel=0, abs_=0)
    assert counts.replays >= 2


def test_what_changes_the_rules_records_anew(counts):
    torch.manual_seed(0)
    model = _mlp().double()
    x, y = _data(False)

    def check(x, y):
        assert_exact(per_sample_grads(model, x, y, _ce), loop_per_sample_grads(model, x, y, _ce))

    for _ in range(4):
        check(x, y)
    assert counts.replays
    check(x[:3], y[:3])  # another batch size
    model[2].bias.requires_grad_(False)  # a parameter frozen: another destination
    for _ in range(4):
        check(x, y)
    model[2].bias.requires_grad_(True)
    with torch.no_grad():
        model[0].weight.mul_(3)  # new values in place: read by the replay
    check(x, y)
    model[0].weight = nn.Parameter(torch.randn(B, E, dtype=torch.float64))  # replaced
    for _ in range(4):
        check(x, y)
    model[4] = nn.Linear(B, 3).double()  # a layer replaced
    for _ in range(4):
        check(x, y)


@pytest.mark.parametrize("build", [_mlp, Block], ids=["stock", "block"])
def test_an_argument_changed_between_calls_records_anew(build, counts):
    """A layer norm's ``eps`` changed after the replay was kept: a value the rule reads
    in Python (the replay holds the recorded one), so the call records again."""
    torch.manual_seed(0)
    model = build().double()
    if build is _mlp:
        model.insert(2, nn.LayerNorm(B).double())
    norm = model[2] if build is _mlp else model.norm
    x, y = _data(build is Block)
    for _ in range(8):
        per_sample_grads(model, x, y, _ce)
    assert counts.replays
    norm.eps = 0.5  # (large: a replay holding 1e-5 would differ far beyond rounding)
    for _ in range(4):
        assert_exact(per_sample_grads(model, x, y, _ce), loop_per_sample_grads(model, x, y, _ce))


class Distances(nn.Module):
    """``cdist`` to learned centres: no rule, its parameter takes an op's VJP."""

    def __init__(self):
        super().__init__()
        self.centres = nn.Parameter(torch.randn(B + 1, E))
        self.lin = nn.Linear(B + 1, 3)

    def forward(self, x):
        return self.lin(torch.cdist(x, self.centres))


def test_a_model_whose_rules_cannot_be_recorded_stops_trying(counts, monkeypatch):
    """An op's VJP (no rule) is never recorded; after the first such call the record's
    later calls do not even build a signature."""
    torch.manual_seed(0)
    model = Distances().double()
    x, y = _data(False)
    signatures = []
    inputs_of = replay.inputs_of
    monkeypatch.setattr(replay, "inputs_of", lambda *a: signatures.append(1) or inputs_of(*a))
    for _ in range(6):
        assert_exact(per_sample_grads(model, x, y, _ce), loop_per_sample_grads(model, x, y, _ce))
    assert counts.replays == 0 and 0 < len(signatures) < 6


def test_the_recorder_refuses_value_reads_and_unknown_tensors():
    a = torch.randn(3)
    rec = replay.Recorder([a])
    with rec:
        (a * 2).sum()
    assert rec.failed is None and rec.replay({}).ops == 2
    rec = replay.Recorder([a])
    with rec:
        if (a > 0).any():  # a value read into Python: its branch cannot be replayed
            a.add_(1)
    assert rec.failed is not None and "reads values" in rec.failed
    other = torch.randn(3)
    rec = replay.Recorder([a])
    with rec:
        a + other  # a tensor that is not an input
    assert rec.failed is not None and "not an input" in rec.failed


def test_the_replay_makes_views_by_their_geometry():
    """Views are made from their root by ``as_strided`` where an op reads them: the
    replay on new inputs computes what the ops compute."""
    a, out = torch.randn(4, 6), torch.empty(3, 4)
    rec = replay.Recorder([a, out])
    with rec:
        torch.mul(a.t()[1:4].unsqueeze(0), 2, out=out.unsqueeze(0))
    kept = rec.replay({})
    b, got = torch.randn(4, 6), torch.empty(3, 4)
    kept([b, got])
    assert torch.equal(got, b.t()[1:4] * 2)


def test_the_check_mode_finds_a_replay_that_differs():
    """``PERSAMPLE_CHECK_REPLAY=1`` (the tests' check of every replay) raises where the
    replay's result is not the rules' bit for bit, NaN included."""
    from persample.errors import InternalError

    a, out = torch.tensor([1.0, float("nan")]), torch.empty(2)
    rec = replay.Recorder([a, out])
    with rec:
        torch.mul(a, 2, out=out)
    kept = rec.replay({})
    replay.check(kept, [a, out], {0: out})  # the same: NaN where NaN
    out[0] = 3.0
    with pytest.raises(InternalError, match="differ"):
        replay.check(kept, [a, out], {0: out})


def test_recording_does_not_import_torchdynamo():
    """A stock model's calls never need TorchDynamo; the recorder must not import it
    (over a second, once per process, at the third call), in a fresh interpreter."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import sys, torch
        from torch import nn
        import persample
        from persample.engine import replay
        m = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 3))
        x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
        for _ in range(5):
            persample.per_sample_grads(m, x, y, nn.CrossEntropyLoss())
        kept = [type(v).__name__ for _, (r, d) in replay._REPLAYS.items() for _, v in d]
        print("torch._dynamo" in sys.modules, kept)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == "False" and "Replay" in done.stdout, done.stdout


@pytest.mark.parametrize("build", [_mlp, Block], ids=["stock-mlp", "block"])
def test_a_dp_steps_norms_and_clipped_sums_are_replayed(build, counts, compiled,
                                                        monkeypatch):
    """A DP step's ghost norms and clipped sums, replayed once its calls are cached: no
    norm or sum rule runs, and every step's ``p.grad`` is the loop's clipped sum on that
    step's own new data (float64, C small enough to clip every sample)."""
    from battery import clipped_mean
    from persample.dp import private_grad
    from persample.engine import norms, uses, weighted

    ran = {"norm": 0, "sum": 0}
    ghost, add = norms.backprops_of, weighted._add_op_sums

    def counted_ghost(*args):
        ran["norm"] += 1
        return ghost(*args)

    def counted_add(*args):
        ran["sum"] += 1
        return add(*args)

    monkeypatch.setattr(norms, "backprops_of", counted_ghost)
    monkeypatch.setattr(uses, "backprops_of", counted_ghost)
    monkeypatch.setattr(weighted, "_add_op_sums", counted_add)
    torch.manual_seed(0)
    model = build().double()
    replays = []
    for call in range(8):
        x, y = _data(build is Block, seed=call)
        before = dict(ran)
        replays_before = counts.replays
        private_grad(model, x, y, _ce, max_grad_norm=1e-3, noise_multiplier=0.0, check="never")
        want = clipped_mean(loop_per_sample_grads(model, x, y, _ce), 1e-3)[1]
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[name], rtol=1e-10, atol=1e-15)
        replays.append(counts.replays - replays_before)
        if call >= 6:  # (cached, recorded: the norms and the sums replayed)
            assert ran == before, f"a replayed DP step ran rules: {ran} after {before}"
            assert replays[-1] >= 2


def test_a_replay_of_the_clipped_sums_that_fails_stops_the_step(counts, monkeypatch):
    """A kept replay of the clipped sums that raises part-way (out of memory, say) has
    added some sums already: no fallback may add them again. The step raises, naming
    the replay, and ``p.grad`` is left as it was."""
    from persample.dp import private_grad
    from persample.engine.weighted import PartialSums

    torch.manual_seed(0)
    model = _mlp().double()
    for call in range(4):  # (the rules, then recorded, then replayed)
        x, y = _data(False, seed=call)
        private_grad(model, x, y, _ce, max_grad_norm=1e-3, noise_multiplier=0.0,
                     check="never")
    call_replay = replay.Replay.__call__

    def failing(kept, inputs):
        if kept.answer is None:  # (the sums' replay: the norms' answer is a list)
            raise RuntimeError("out of memory (a test's)")
        return call_replay(kept, inputs)

    monkeypatch.setattr(replay.Replay, "__call__", failing)
    sentinel = {name: torch.full_like(p, 7.0) for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        p.grad = sentinel[name].clone()
    x, y = _data(False, seed=9)
    with pytest.raises(PartialSums, match="replayed clipped sums.*out of memory"):
        private_grad(model, x, y, _ce, max_grad_norm=1e-3, noise_multiplier=0.0,
                     check="never")
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, sentinel[name])
