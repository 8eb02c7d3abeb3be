"""``input_jacobian`` and ``jacobian_diagonal`` against ``torch.autograd.functional.jacobian``.

The reference is the full ``(B, *out_shape, B, *in_shape)`` Jacobian in float64,
of which the diagonal blocks ``[i, ..., i, ...]`` are kept. Cases are data: one
dict per model, ``module_fn()`` and ``in_shape``.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from persample import jacobian as jac_mod
from persample.jacobian import input_jacobian, jacobian_diagonal

N = 3
MODES = ["auto", "reverse", "forward"]
CHUNKS = [None, 1, 3, 1000]


class SelfAttention(nn.Module):
    """Attention over the positions of one sample (batch_first): samples stay apart."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 8)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 4) -> (B, T, 8)
        return self.head(self.attn(x, x, x, need_weights=False)[0])


class Reused(nn.Module):
    """One Linear called twice and a direct parameter (weight reuse)."""

    def __init__(self):
        super().__init__()
        self.cell = nn.Linear(4, 4)
        self.gain = nn.Parameter(torch.randn(4))

    def forward(self, x: Tensor) -> Tensor:
        return self.cell(torch.tanh(self.cell(x)) * self.gain)


def bn_eval() -> nn.Module:
    """BatchNorm in eval mode with non-trivial running statistics: samples independent."""
    bn = nn.BatchNorm1d(5)
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    return nn.Sequential(nn.Linear(3, 5), bn, nn.Tanh(), nn.Linear(5, 7)).eval()


def conv_image(side: int = 8) -> nn.Module:
    """Images ``(B, 3, side, side)`` to ``(B, 2, 5)``."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(side * side, 10), nn.Tanh(), nn.Unflatten(1, (2, 5)),
    )


def mlp(sizes: list[int], act: type[nn.Module]) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), act()]
    return nn.Sequential(*layers[:-1])


CASES = [
    {"id": "mlp-tanh", "module_fn": lambda: mlp([3, 16, 5], nn.Tanh), "in_shape": (3,)},
    {"id": "mlp-relu", "module_fn": lambda: mlp([6, 8, 8, 2], nn.ReLU), "in_shape": (6,)},
    # a PINN's Jacobian diagonal blocks, small: (B, 1) -> (B, 40)
    {"id": "pinn", "module_fn": lambda: mlp([1, 20, 20, 40], nn.Tanh), "in_shape": (1,)},
    # a classifier's input Jacobian, small: (B, 49) -> (B, 10)
    {"id": "clf", "module_fn": lambda: mlp([49, 16, 16, 10], nn.ReLU), "in_shape": (49,)},
    {"id": "conv-image", "module_fn": lambda: conv_image(4), "in_shape": (3, 4, 4)},
    {"id": "bn-eval", "module_fn": bn_eval, "in_shape": (3,)},
    {"id": "reused", "module_fn": Reused, "in_shape": (4,)},
    # CPU attention has no forward-mode formula: "forward" raises, "auto" falls back
    {"id": "attention", "module_fn": SelfAttention, "in_shape": (5, 4), "no_forward_ad": True},
    # a plain function, not a module; (B,) inputs: in_shape ()
    {"id": "function", "module_fn": lambda: lambda x: torch.sin(x) * x.sum(-1, keepdim=True),
     "in_shape": (4,)},
    {"id": "scalar-in", "module_fn": lambda: lambda x: torch.stack([x, x**2, x.exp()], 1),
     "in_shape": ()},
]
IDS = [c["id"] for c in CASES]


def build(c: dict, n: int = N) -> tuple:
    torch.manual_seed(0)
    model = c["module_fn"]()
    if isinstance(model, nn.Module):
        model = model.double()
    return model, torch.randn(n, *c["in_shape"])


def reference(c: dict, n: int = N) -> tuple:
    """``(model, x, diagonal blocks)`` of a case, the blocks computed once per ``(id, n)``."""
    model, x = build(c, n)
    key = (c["id"], n)
    if key not in _REFERENCES:
        _REFERENCES[key] = diagonal_blocks(model, x)
    return model, x, _REFERENCES[key]


_REFERENCES: dict[tuple, Tensor] = {}


def diagonal_blocks(model, x: Tensor) -> Tensor:
    """``(B, *out_shape, *in_shape)`` from the full Jacobian ``(B, *out_shape, B, *in_shape)``."""
    full = torch.autograd.functional.jacobian(model, x)
    out_dims = full.dim() - x.dim() - 1
    return torch.stack([full[i].select(out_dims, i) for i in range(x.shape[0])])


def spy(monkeypatch, name: str) -> list[int]:
    """Record the number of one-hot vectors in each call of ``jacobian._<name>``."""
    sizes: list[int] = []
    real = getattr(jac_mod, name)

    def wrapper(*args, **kwargs):
        sizes.append(args[2].shape[0])  # (c, B, ...)
        return real(*args, **kwargs)

    monkeypatch.setattr(jac_mod, name, wrapper)
    return sizes


# ---------------------------------------------------------------------------
# input_jacobian


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("c", CASES, ids=IDS)
def test_input_jacobian_matches_reference(c, mode, chunk_size):
    model, x, want = reference(c)
    if mode == "forward" and c.get("no_forward_ad"):
        with pytest.raises(NotImplementedError, match="forward AD"):
            input_jacobian(model, x, mode=mode, chunk_size=chunk_size)
        return
    got = input_jacobian(model, x, mode=mode, chunk_size=chunk_size)
    assert got.shape == want.shape
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("mode", "chunk_size"), [("reverse", None), ("forward", 50)])
def test_image_to_matrix(mode, chunk_size):
    """Images ``(B, 3, 8, 8)`` to ``(B, 2, 5)``: blocks ``(B, 2, 5, 3, 8, 8)``."""
    c = {"id": "conv-image-8", "module_fn": conv_image, "in_shape": (3, 8, 8)}
    model, x, want = reference(c, 2)
    got = input_jacobian(model, x, mode=mode, chunk_size=chunk_size)
    assert got.shape == (2, 2, 5, 3, 8, 8)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", ["auto", "reverse"])
@pytest.mark.parametrize("c", CASES, ids=IDS)
def test_batch_of_one(c, mode):
    model, x, want = reference(c, 1)
    torch.testing.assert_close(input_jacobian(model, x, mode=mode), want)


@pytest.mark.parametrize("mode", MODES)
def test_batch_of_zero_gives_empty_result(mode):
    model = conv_image().double()
    got = input_jacobian(model, torch.randn(0, 3, 8, 8), mode=mode)
    assert got.shape == (0, 2, 5, 3, 8, 8)


class _OnceDifferentiableCube(torch.autograd.Function):
    """x ** 3 with a backward that cannot be differentiated, and no forward-mode rule."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g


def test_auto_falls_back_to_reverse_without_double_backward_or_forward_ad():
    """Neither forward way works: auto is still exact (reverse), forward mode raises."""
    lin = nn.Linear(2, 5)

    def model(x):
        return _OnceDifferentiableCube.apply(lin(x))

    x = torch.randn(N, 2)
    want = diagonal_blocks(model, x)  # D = 2 < Y = 5: auto tries forward first
    torch.testing.assert_close(input_jacobian(model, x), want)
    with pytest.raises(RuntimeError):
        input_jacobian(model, x, mode="forward")


def test_auto_picks_forward_when_fewer_inputs_than_outputs(monkeypatch):
    forward, reverse = spy_calls(monkeypatch, "_double_backward_jacobian"), spy_calls(
        monkeypatch, "_reverse_jacobian")
    pinn, x = build(CASES[IDS.index("pinn")])  # D = 1 < Y = 40
    input_jacobian(pinn, x)
    assert (forward, reverse) == ([1], [])
    clf, x = build(CASES[IDS.index("clf")])  # D = 49 >= Y = 10
    input_jacobian(clf, x)
    assert (forward, reverse) == ([1], [1])


def spy_calls(monkeypatch, name: str) -> list[int]:
    """Count the calls of ``jacobian.<name>`` (as a list of 1s, one per call)."""
    calls: list[int] = []
    real = getattr(jac_mod, name)

    def wrapper(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(jac_mod, name, wrapper)
    return calls


@pytest.mark.parametrize(
    ("mode", "name", "sizes"), [("reverse", "_pull", [3, 3, 1]), ("forward", "_pull", [3])]
)
def test_chunk_size_bounds_the_one_hot_vectors_at_once(monkeypatch, mode, name, sizes):
    sizes_seen = spy(monkeypatch, name)
    model, x = build(CASES[IDS.index("mlp-tanh")])  # D = 3, Y = 5 ... Y = 7 below
    model = nn.Sequential(model, nn.Linear(5, 7)).double()
    input_jacobian(model, x, mode=mode, chunk_size=3)
    assert sizes_seen == sizes


@pytest.mark.parametrize("mode", MODES)
def test_output_dtype_follows_the_model(mode):
    net = mlp([3, 8, 4], nn.Tanh).float()
    x = torch.randn(N, 3)  # float64 input, float32 model
    got = input_jacobian(lambda v: net(v.float()), x, mode=mode)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, diagonal_blocks(net, x.float()))


@pytest.mark.parametrize("mode", MODES)
def test_works_under_no_grad(mode):
    model, x, want = reference(CASES[IDS.index("mlp-tanh")])
    with torch.no_grad():
        got = input_jacobian(model, x, mode=mode, check_independence=True)
        diag = jacobian_diagonal(torch.tanh, x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(diag, 1 - torch.tanh(x) ** 2)


@pytest.mark.parametrize("mode", MODES)
def test_output_independent_of_input_gives_zeros(mode):
    bias = nn.Parameter(torch.randn(4))
    got = input_jacobian(lambda v: bias * v.new_ones(v.shape[0], 1), torch.randn(N, 2), mode=mode)
    assert got.shape == (N, 4, 2)
    assert torch.count_nonzero(got) == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_model_and_inputs_untouched(snapshot, mode, requires_grad):
    model = bn_eval()
    model[0].weight.grad = torch.ones_like(model[0].weight)  # an existing grad stays as is
    state = snapshot(model)
    x = torch.randn(N, 3, requires_grad=requires_grad)
    before = x.detach().clone()
    input_jacobian(model, x, mode=mode, check_independence=True)
    state.assert_unchanged()
    assert model[3].weight.grad is None
    assert not model[1]._forward_hooks
    assert x.requires_grad is requires_grad and x.grad is None
    assert torch.equal(x.detach(), before)


# ---------------------------------------------------------------------------
# check_independence


@pytest.mark.parametrize("mode", MODES)
def test_check_independence_passes_on_independent_model(mode):
    model, x, want = reference(CASES[IDS.index("conv-image")])
    got = input_jacobian(model, x, mode=mode, check_independence=True)
    torch.testing.assert_close(got, want)


def batchnorm_train() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double().train()


@pytest.mark.parametrize(
    "model_fn", [lambda: (lambda x: x - x.mean(0)), batchnorm_train], ids=["centre", "bn-train"]
)
@pytest.mark.parametrize("mode", MODES)
def test_check_independence_raises_on_mixing(snapshot, model_fn, mode):
    model = model_fn()
    state = snapshot(model) if isinstance(model, nn.Module) else None
    with pytest.raises(ValueError, match="output of sample 0 depends on the input of sample 1"):
        input_jacobian(model, torch.randn(4, 3), mode=mode, check_independence=True)
    if state is not None:
        state.assert_unchanged()  # running statistics restored, still in training mode


def test_check_independence_catches_one_way_mixing():
    """Sample 1's output reads sample 0's input, not the other way round."""

    def model(x: Tensor) -> Tensor:
        return x + torch.cat([x[:1] * 0, x[:-1]]) ** 2

    with pytest.raises(ValueError, match="output of sample 1 depends on the input of sample 0"):
        input_jacobian(model, torch.randn(3, 2), check_independence=True)


def test_check_independence_on_a_batch_of_one_has_nothing_to_check():
    got = input_jacobian(lambda x: x - x.mean(0), torch.randn(1, 3), check_independence=True)
    assert torch.count_nonzero(got) == 0  # the mean of one sample is itself


# ---------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    ("inputs", "error", "match"),
    [
        ([[1.0, 2.0]], TypeError, "must be a tensor"),
        (torch.tensor(1.0), ValueError, "0-dim"),
        (torch.ones(3, 2, dtype=torch.long), TypeError, "floating point"),
    ],
    ids=["list", "0-dim", "int"],
)
def test_bad_inputs(inputs, error, match):
    with pytest.raises(error, match=match):
        input_jacobian(nn.Linear(2, 2).double(), inputs)
    with pytest.raises(error, match=match):
        jacobian_diagonal(torch.tanh, inputs)


@pytest.mark.parametrize("mode", MODES)
def test_output_without_the_batch_dim(mode):
    with pytest.raises(ValueError, match=r"batch of 4 samples to an output of shape \(3,\)"):
        input_jacobian(lambda x: x.sum(0), torch.randn(4, 3), mode=mode)
    with pytest.raises(ValueError, match=r"output of shape \(\)"):
        input_jacobian(lambda x: x.sum(), torch.randn(4, 3), mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_output_not_a_tensor(mode):
    with pytest.raises(TypeError, match="returned tuple"):
        input_jacobian(lambda x: (x, x), torch.randn(4, 3), mode=mode)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "backward"}, "mode='backward' is not one of"),
        ({"chunk_size": 0}, "chunk_size must be a positive int"),
        ({"chunk_size": -2}, "chunk_size must be a positive int"),
        ({"chunk_size": 2.0}, "chunk_size must be a positive int"),
        ({"chunk_size": True}, "chunk_size must be a positive int"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        input_jacobian(nn.Linear(2, 2).double(), torch.randn(3, 2), **kwargs)


# ---------------------------------------------------------------------------
# jacobian_diagonal

DIAG_CASES = {
    "tanh": lambda: torch.tanh,
    "x-sin-x": lambda: lambda x: x * torch.sin(x),
    "linear-tanh": lambda: nn.Sequential(nn.Linear(6, 6), nn.Tanh()),
    "image": lambda: nn.Sequential(
        nn.Flatten(), nn.Linear(6, 6), nn.Tanh(), nn.Unflatten(1, (2, 3))
    ),
    "softmax": lambda: lambda x: torch.softmax(x, -1) * x,
}
DIAG_SHAPES = {"image": (2, 3)}


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("name", list(DIAG_CASES))
def test_jacobian_diagonal_matches_reference(name, chunk_size):
    fn = DIAG_CASES[name]()
    fn = fn.double() if isinstance(fn, nn.Module) else fn
    x = torch.randn(4, *DIAG_SHAPES.get(name, (6,)))
    blocks = diagonal_blocks(fn, x).reshape(4, 6, 6)  # (B, D, D)
    want = blocks.diagonal(0, 1, 2).reshape(x.shape)
    got = jacobian_diagonal(fn, x, chunk_size=chunk_size)
    assert got.shape == x.shape
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_jacobian_diagonal_of_linear_is_the_weight_diagonal():
    lin = nn.Linear(5, 5).double()
    got = jacobian_diagonal(lin, torch.randn(3, 5), chunk_size=2)
    torch.testing.assert_close(got, lin.weight.diagonal().expand(3, 5))


def test_jacobian_diagonal_default_chunks_bound_memory(monkeypatch):
    monkeypatch.setattr(jac_mod, "_CHUNK_NUMBERS", 64)  # n * d = 16: 4 directions a chunk
    sizes = spy(monkeypatch, "_push")
    fn = nn.Sequential(nn.Linear(8, 8), nn.Tanh()).double()
    x = torch.randn(2, 8)
    got = jacobian_diagonal(fn, x)
    assert sizes == [4, 4]
    want = diagonal_blocks(fn, x).diagonal(0, 1, 2)
    torch.testing.assert_close(got, want)


def test_jacobian_diagonal_batch_of_one_and_zero():
    fn = nn.Sequential(nn.Linear(6, 6), nn.Tanh()).double()
    x = torch.randn(1, 6)
    torch.testing.assert_close(jacobian_diagonal(fn, x), diagonal_blocks(fn, x)[0].diagonal()[None])
    assert jacobian_diagonal(fn, torch.randn(0, 6)).shape == (0, 6)


@pytest.mark.parametrize("n", [0, 3])
def test_jacobian_diagonal_needs_square_map(snapshot, n):
    fn = nn.Linear(4, 3).double()
    state = snapshot(fn)
    with pytest.raises(ValueError, match=r"outputs of shape \(" + str(n) + r", 3\).*square"):
        jacobian_diagonal(fn, torch.randn(n, 4))
    state.assert_unchanged()


def test_jacobian_diagonal_leaves_model_and_inputs_untouched(snapshot):
    fn = nn.Sequential(nn.Linear(6, 6), nn.Tanh()).double()
    state = snapshot(fn)
    x = torch.randn(3, 6, requires_grad=True)
    jacobian_diagonal(fn, x, chunk_size=4)
    state.assert_unchanged()
    assert x.requires_grad and x.grad is None
    assert all(p.grad is None for p in fn.parameters())
