"""The configurations of three peer suites, run with persample under test.

Each configuration is a model, a batch and a loss that another per-sample gradient
library tests itself on; here each goes through ``battery.check`` against the loop over
samples (:func:`persample.loop_per_sample_grads`) in float64: ``per_sample_grads`` and
the norms of ``per_sample_grad_norms`` (total and per layer) with ``method="auto"``
(which must not leave the rules on these stock layers) and ``"rules"``, the clipped
sums of ``persample.dp.private_grad`` without noise, the path ``supported`` reports,
and the model left as it was.

1. PyTorch's OpInfo samples of the ops with expanded-weight support
   (``op.supports_expanded_weight``: linear, conv1d/2d/3d, embedding, group_norm,
   instance_norm, layer_norm) and the module tests of ``common_nn`` for the same
   layers, as torch's own expanded-weights test reads them: the sample's ``input`` is
   the batch (dim 0), every other tensor that requires grad a parameter, the loss each
   sample's ``op(...).sum()``; a module called twice on the same input too.
2. Opacus's ``grad_samples`` layer configurations, drawn with hypothesis over the same
   spaces (batch size including 0, channels, kernel, stride, padding, dilation, groups,
   affine, ``batch_first``), with an L1 loss against zeros reduced by sum or mean:
   Conv1d/2d/3d, Embedding, EmbeddingBag, GroupNorm, InstanceNorm1d/2d/3d, LayerNorm,
   Linear, RMSNorm.
3. BackPACK's ``batch_grad`` problems: Linear stacks (with extra dims), Conv1d/2d/3d and
   ConvTranspose1d/2d/3d under a frozen head, BatchNorm1d/2d/3d in eval mode,
   Embedding, RNN and LSTM, a torchvision ResNet-18 in eval mode, with
   CrossEntropyLoss or MSELoss, summed or averaged.

Sizes coincide where the peers' do (batch = channels = groups = sequence length), so a
guess of where the batch is from a size would show.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import hypothesis
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import persample.rules as rules_module
from battery import assert_matches, check
from persample import PackedRows, loop_per_sample_grads, per_sample_grad_norms, per_sample_grads
from zoo import require

ON_RULES = {"rule", "module rule"}  # op rules; a recurrent layer's rule
HYPOTHESIS = settings(max_examples=25, deadline=None,
                      suppress_health_check=[HealthCheck.function_scoped_fixture])


def check_against_loop(model: nn.Module, x: Any, y: Any, loss_fn: Callable
                       ) -> dict[str, Tensor]:
    """``battery.check``: every public function on ``model`` against the loop, each
    answered from the rules: ``supported`` says "rule" (or "module rule", a recurrent
    layer's) for every trainable parameter, ``method="rules"`` answers, and ``auto``
    never leaves the rules. The peers' batches may hold no sample, and their samples
    zero gradients (an embedding without ids): not refused here."""
    return check(model, x, y, loss_fn, paths=None, paths_within=ON_RULES, nonzero=False)


def out_sum(out: Tensor, _: Any) -> Tensor:
    """Each sample's ``out.sum()``: ``(B,)``."""
    return out.flatten(1).sum(1)


# ---------------------------------------------------------------------------
# 1. PyTorch: OpInfo samples of the ops with expanded-weight support, common_nn modules

OPINFO_OPS = ["nn.functional.conv1d", "nn.functional.conv2d", "nn.functional.conv3d",
              "nn.functional.embedding", "nn.functional.group_norm",
              "nn.functional.instance_norm", "nn.functional.layer_norm",
              "nn.functional.linear"]
COMMON_NN = ("Linear", "Conv1d", "Conv2d", "Conv3d", "Embedding", "LayerNorm", "GroupNorm")


@functools.cache
def torch_testing() -> tuple[dict, list[dict]]:
    """``({op name: OpInfo}, common_nn module tests)`` from torch's own test utilities.

    Importing them loads their hypothesis profile (10 examples, no database) and
    forbids setting ``torch.backends`` flags outside a context manager; both are put
    back as they were, for the rest of the session."""
    profile, frozen = hypothesis.settings.default, torch.backends.flags_frozen()
    from torch.testing._internal import common_nn  # needs expecttest (the test extra)
    from torch.testing._internal.common_methods_invocations import op_db

    hypothesis.settings.register_profile("persample-tests", profile)
    hypothesis.settings.load_profile("persample-tests")
    if not frozen:
        vars(torch.backends)["__allow_nonbracketed_mutation_flag"] = True
    ops = {op.name: op for op in op_db if op.supports_expanded_weight}
    tests = [t for t in common_nn.module_tests + common_nn.get_new_module_tests()
             if t.get("module_name") in COMMON_NN]
    return ops, tests


class Slot:
    """Where a parameter of :class:`OpCall` goes in the op's arguments."""

    def __init__(self, name: str):
        self.name = name


class OpCall(nn.Module):
    """``fn(x, *args, **kwargs)`` with the arguments that require grad held as parameters
    (``p0``, ``p1``, ... in argument order) and the others (running statistics, sizes)
    passed as they are."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict):
        super().__init__()
        self.fn = fn
        self.args = [self._hold(a) for a in args]
        self.kwargs = {k: self._hold(a) for k, a in kwargs.items()}

    def _hold(self, a: Any) -> Any:
        if isinstance(a, Tensor) and a.requires_grad:
            slot = Slot(f"p{len(self._parameters)}")
            self.register_parameter(slot.name, nn.Parameter(a.detach().clone()))
            return slot
        return a

    def _value(self, a: Any) -> Any:
        return getattr(self, a.name) if isinstance(a, Slot) else a

    def forward(self, x: Tensor) -> Tensor:
        kwargs = {k: self._value(a) for k, a in self.kwargs.items()}
        return self.fn(x, *map(self._value, self.args), **kwargs)


def opinfo_call(op, sample) -> tuple[Callable, Tensor, tuple] | None:
    """``(fn, batch, args)`` of an OpInfo sample, or None where its input has no batch
    dim (a single vector for linear, ``(C, *size)`` for a convolution, a scalar index, a
    layer_norm whose normalized shape is the whole input) or nothing requires grad."""
    fn, x, args = op.op, sample.input, sample.args
    if op.name == "nn.functional.embedding":  # OpInfo passes (weight, indices)
        fn, x, args = F.embedding, args[0], (x,)
    needs_grad = [a for a in (*args, *sample.kwargs.values())
                  if isinstance(a, Tensor) and a.requires_grad]
    return (fn, x, args) if needs_grad and batched(op.name, x, args) else None


def batched(name: str, x: Tensor, args: tuple) -> bool:
    """Whether dim 0 of an OpInfo sample's input is a batch dim."""
    if name == "nn.functional.linear":
        return x.dim() >= 2
    if name == "nn.functional.embedding":
        return x.dim() >= 1
    if name == "nn.functional.layer_norm":
        return x.dim() > len(args[0])
    if "conv" in name:
        return x.dim() == args[0].dim()  # (N, C, *size) against weight (O, C/g, *kernel)
    return True


def test_opinfo_covers_every_op_with_expanded_weights():
    """A torch that adds an op with expanded-weight support adds it to the tests below."""
    ops, _ = torch_testing()
    assert sorted(ops) == sorted(OPINFO_OPS)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("name", OPINFO_OPS)
def test_opinfo_samples_match_the_loop(name):
    """Every batched OpInfo sample of the op (float64, requires_grad): per-sample
    gradients of each sample's ``op(...).sum()`` over the tensors that require grad."""
    ops, _ = torch_testing()
    checked = 0
    for k, sample in enumerate(ops[name].sample_inputs("cpu", torch.float64,
                                                        requires_grad=True)):
        call = opinfo_call(ops[name], sample)
        if call is None:
            continue
        fn, x, args = call
        model = OpCall(fn, args, sample.kwargs)
        try:
            check_against_loop(model, x, None, out_sum)
        except AssertionError as err:
            raise AssertionError(f"sample {k}: {sample}: {err}") from err
        checked += 1
    assert checked >= 2


class Twice(nn.Module):
    """The module called twice on the same input, the outputs added."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x: Tensor) -> Tensor:
        return self.module(x) + self.module(x)


def common_nn_case(test: dict) -> tuple[nn.Module, Tensor] | None:
    """``(module, input)`` of a common_nn module test, or None where the module has no
    parameter or its input no batch dim."""
    cls = test.get("constructor", getattr(nn, test["module_name"]))
    module = cls(*test.get("constructor_args", ())).double()
    x = test["input_fn"]() if "input_fn" in test else torch.randn(test["input_size"])
    x = x if module.__class__ is nn.Embedding else x.double()
    batched = x.dim() >= 2 or (module.__class__ is nn.Embedding and x.dim() >= 1)
    return (module, x) if batched and list(module.parameters()) else None


def test_common_nn_module_tests_match_the_loop():
    """torch's module tests of the layers with expanded-weight support, each module once
    and called twice; batches of 0 samples included."""
    _, tests = torch_testing()
    checked = 0
    for test in tests:
        case = common_nn_case(test)
        if case is None:
            continue
        module, x = case
        for model in (module, Twice(module)):
            try:
                check_against_loop(model, x, None, out_sum)
            except AssertionError as err:
                raise AssertionError(f"{test['module_name']} {test.get('desc')}: {err}") from err
        checked += 1
    assert checked >= 20


@pytest.mark.parametrize("options", [
    {"max_norm": 1.0, "padding_idx": 0},
    {"max_norm": 1.0, "padding_idx": 0, "sparse": True},
    {"max_norm": 1.0, "padding_idx": 0, "scale_grad_by_freq": True},
], ids=["max-norm", "max-norm-sparse", "max-norm-freq"])
def test_embedding_options_of_torchs_expanded_weights_tests(options):
    """torch's embedding tests: rows of norm above ``max_norm``, which the forward renorms
    in place (a plain forward changes the weight; once renormed it stays), a padding row,
    sparse gradients, gradients scaled by the ids' frequency in the batch... and in each
    sample, which is what the loop's each-sample forward sees."""
    model = nn.Embedding(5, 5, **options)
    with torch.no_grad():
        model.weight.add_(2)
    ids = torch.randint(5, (3, 3))
    fresh = copy.deepcopy(model)
    want = loop_per_sample_grads(copy.deepcopy(fresh), ids, None, out_sum)
    assert_matches(per_sample_grads(fresh, ids, None, out_sum, method="rules"), want, "fresh")
    model(ids)  # renormed: the forward no longer changes the weight
    assert torch.equal(model.weight, fresh.weight)
    check_against_loop(model, ids, None, out_sum)


# ---------------------------------------------------------------------------
# 2. Opacus: grad_samples layer configurations (hypothesis)


def l1(reduction: str) -> Callable:
    """Opacus's test loss: L1 against zeros, each sample's own, summed or averaged."""
    loss = nn.L1Loss(reduction=reduction)
    return lambda out, _: loss(out, torch.zeros_like(out))


class BatchInDim1(nn.Module):
    """``layer(x.transpose(0, 1))``: the samples (dim 0 of the input as given) are dim 1
    of the layer's input and output, as Opacus's ``batch_first=False``."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x.transpose(0, 1))


def divisors(n: int, most: int) -> list[int]:
    return [g for g in range(1, most + 1) if n % g == 0]


@st.composite
def conv_configs(draw, d: int):
    """Opacus's Conv{d}d space: batch 0-4, channels 1/3/32, out 2C or C//2, groups
    dividing both, padding int, tuple, "same" (stride 1) or "valid"."""
    torch.manual_seed(draw(st.integers(0, 2**16)))
    c = draw(st.sampled_from([1, 3, 32]))
    out = draw(st.sampled_from([2 * c, max(1, c // 2)]))
    groups = draw(st.sampled_from(divisors(c, 16 if d > 1 else 12)))
    if out % groups:
        groups = 1
    kernel = draw(st.sampled_from({1: [2, 3], 2: [2, 3, 4], 3: [2, 3, (1, 2, 3)]}[d]))
    stride = draw(st.sampled_from({1: [1, 2], 2: [1, 2], 3: [1, 2, (1, 2, 3)]}[d]))
    pads = {1: [0, 1, 2, "valid"], 2: [0, 2, "valid"], 3: [0, 2, (1, 2, 3), "valid"]}[d]
    padding = draw(st.sampled_from(pads + (["same"] if stride == 1 else [])))
    dilation = draw(st.sampled_from({1: [1, 2], 2: [1, 2, 3], 3: [1, (1, 2, 2)]}[d]))
    size = {1: [draw(st.integers(6, 10))],
            2: [draw(st.integers(11, 17)), draw(st.integers(11, 17))],
            3: [draw(st.integers(3, 6)), draw(st.integers(6, 10)), draw(st.integers(6, 10))]}[d]
    layer = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[d - 1](
        c, out, kernel, stride=stride, padding=padding, dilation=dilation, groups=groups)
    return layer, torch.randn(draw(st.integers(0, 4)), c, *size)


@st.composite
def embedding_configs(draw):
    """Opacus's Embedding space: ids ``(N, T[, Q[, R]])``, batch_first either way (with
    batch_first=False the samples are dim 1, of size T). N = 0 there (T samples without
    an id) is test_opacus_embedding_samples_without_ids."""
    torch.manual_seed(draw(st.integers(0, 2**16)))
    batch_first = draw(st.booleans())
    n = draw(st.integers(0 if batch_first else 1, 4))
    t, q, r = (draw(st.integers(*b)) for b in ((1, 5), (1, 4), (1, 2)))
    dim = draw(st.integers(2, 4))
    vocab, width = draw(st.integers(2, 32)), draw(st.integers(10, 17))
    ids = torch.randint(0, vocab, [n, t, q, r][:dim])
    if batch_first:
        return nn.Embedding(vocab, width), ids
    return BatchInDim1(nn.Embedding(vocab, width)), ids.transpose(0, 1)


@st.composite
def linear_configs(draw):
    """Opacus's Linear space: ``(N, W)``, ``(N, Z, W)``, ``(N, Z, H, W)``, bias or not,
    batch_first either way (batch_first=False: the layer's input is ``(Z, N, ...)``)."""
    torch.manual_seed(draw(st.integers(0, 2**16)))
    n, z, h, w = (draw(st.integers(*b)) for b in ((0, 4), (1, 4), (1, 3), (10, 17)))
    dim = draw(st.integers(2, 4))
    x = torch.randn([n, z, h, w][:dim - 1] + [w])
    layer = nn.Linear(w, w + 2, bias=draw(st.booleans()))
    if dim > 2 and not draw(st.booleans()):
        return BatchInDim1(layer), x
    return layer, x


@st.composite
def group_norm_configs(draw):
    """Opacus's GroupNorm space: batch 0-4, channels 1-8, 1, 4 or C groups, affine."""
    torch.manual_seed(draw(st.integers(0, 2**16)))
    n, c = draw(st.integers(0, 4)), draw(st.integers(1, 8))
    groups = draw(st.sampled_from([g for g in (1, 4, c) if c % g == 0]))
    x = torch.randn(n, c, draw(st.integers(5, 10)), draw(st.integers(4, 8)))
    return nn.GroupNorm(groups, c, affine=True), x


@st.composite
def instance_norm_configs(draw):
    """InstanceNorm1d/2d/3d, affine, no running statistics: batch 1-4, channels 1-3."""
    torch.manual_seed(draw(st.integers(0, 2**16)))
    d = draw(st.integers(1, 3))
    n, c = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    size = [draw(st.integers(1, 4)), draw(st.integers(4, 8)), draw(st.integers(5, 10))][-d:]
    layer = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)[d - 1]
    return layer(c, affine=True, track_running_stats=False), torch.randn(n, c, *size)


@st.composite
def last_dims_norm_configs(draw, layer: type):
    """LayerNorm or RMSNorm over the last 1-3 dims of a 2-4 dim input: batch 1-4."""
    torch.manual_seed(draw(st.integers(0, 2**16)))
    n, z, h, w = (draw(st.integers(*b)) for b in ((1, 4), (1, 4), (1, 3), (5, 10)))
    dim = draw(st.integers(2, 4))
    shape = [n, z, h][:dim - 1] + [w]
    normalized = shape[-draw(st.integers(1, dim - 1)):]
    return layer(normalized, elementwise_affine=True), torch.randn(shape)


OPACUS_LAYERS = {
    "conv1d": conv_configs(1), "conv2d": conv_configs(2), "conv3d": conv_configs(3),
    "embedding": embedding_configs(), "linear": linear_configs(),
    "group_norm": group_norm_configs(), "instance_norm": instance_norm_configs(),
    "layer_norm": last_dims_norm_configs(nn.LayerNorm),
    "rms_norm": last_dims_norm_configs(nn.RMSNorm),
}


@pytest.mark.parametrize("layer", list(OPACUS_LAYERS))
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@HYPOTHESIS
@given(data=st.data())
def test_opacus_layer_configurations(layer, reduction, data):
    """A drawn configuration of the layer, under Opacus's L1 loss."""
    model, x = data.draw(OPACUS_LAYERS[layer])
    check_against_loop(model.double(), x, None, l1(reduction))


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_opacus_embedding_samples_without_ids(reduction):
    """Opacus's Embedding with batch_first=False and N = 0: ids ``(0, T)``, so the T
    samples (dim 1) hold no id; every gradient is zero."""
    ids = torch.randint(0, 5, (0, 3))  # (N, T)
    model = BatchInDim1(nn.Embedding(5, 10))
    check_against_loop(model, ids.transpose(0, 1), None, l1(reduction))


@pytest.mark.parametrize("layer", [nn.Linear, nn.LayerNorm])
def test_samples_without_rows_under_a_summed_output(layer):
    """Opacus's Linear and LayerNorm with Z = 0 rows per sample, under PyTorch's
    per-sample ``out.sum()`` loss (which flattens each sample's output)."""
    model = nn.Linear(4, 2) if layer is nn.Linear else nn.LayerNorm(4)
    check_against_loop(model, torch.randn(3, 0, 4), None, out_sum)


# Opacus's embedding norm-sample cases: ids and the backprops of the embedding's output,
# with repeated ids within a sample; the expected norms are Opacus's (4 decimals)
EMBEDDING_NORM_CASES = [
    ([[1, 1], [2, 0], [2, 0]], [[[0.2], [0.2]], [[0.3], [0.1]], [[0.3], [0.1]]],
     [0.4, 0.3162, 0.3162]),
    ([[[1]], [[1]], [[2]], [[0]], [[2]], [[0]]],
     [[[[0.2, 0.2]]], [[[0.2, 0.2]]], [[[0.3, 0.3]]], [[[0.1, 0.1]]], [[[0.3, 0.3]]],
      [[[0.1, 0.1]]]],
     [0.2828, 0.2828, 0.4243, 0.1414, 0.4243, 0.1414]),
    ([[[0], [0], [0], [0], [0], [0]], [[1], [0], [0], [0], [0], [0]],
      [[2], [3], [4], [5], [6], [7]], [[4], [3], [0], [0], [0], [0]],
      [[8], [7], [9], [6], [5], [0]]],
     [[[[b]]] * 6 for b in (0.0025, -0.0014, -0.0002, 0.0019, -0.0016)],
     [0.0150, 0.0071, 0.0005, 0.0081, 0.0039]),
]


@pytest.fixture
def embedding_ghosts(patch_spec) -> list[bool]:
    """Wrap the norm rule of ``F.embedding``: one entry per call, whether it gave norms
    (the ghost norm) rather than declining (materialised)."""
    took: list[bool] = []
    norm = rules_module.spec_of(F.embedding).norm

    def spy(call, g, wanted):
        try:
            got = norm(call, g, wanted)
        except rules_module.Decline:
            took.append(False)
            raise
        took.append(True)
        return got

    patch_spec(F.embedding, norm=spy)
    return took


@pytest.mark.parametrize("vocab", [None, 64], ids=["opacus-vocab", "vocab-64"])
@pytest.mark.parametrize("case", range(len(EMBEDDING_NORM_CASES)))
def test_opacus_embedding_norm_sample_cases(case, vocab, embedding_ghosts):
    """Each sample's loss is ``<embedding(ids), backprops>``, so the embedding's backprops
    are Opacus's; the norms are theirs and the loop's. Opacus's tables (3, 3 and 10 rows)
    take the ghost norm where T^2 < rows (the second case) and are materialised elsewhere;
    a table of 64 rows takes the ghost norm in every case."""
    ids, backprops, norms = EMBEDDING_NORM_CASES[case]
    ids, backprops = torch.tensor(ids), torch.tensor(backprops)
    rows = vocab or int(ids.max()) + 1
    model = nn.Embedding(rows, backprops.shape[-1])
    with torch.no_grad():
        model.weight.copy_(torch.arange(1, rows + 1).unsqueeze(1) / 10)

    def inner(out: Tensor, bp: Tensor) -> Tensor:
        return (out * bp).flatten(1).sum(1)  # (B,)

    check_against_loop(model, ids, backprops, inner)
    got = per_sample_grad_norms(model, ids, backprops, inner, method="rules")
    torch.testing.assert_close(got, torch.tensor(norms), rtol=0, atol=1e-4)
    t = ids[0].numel()  # ids per sample
    assert embedding_ghosts[-1] == (t * t < rows)


class Bags(nn.Module):
    """``model(PackedRows(ids, bag of each id, N))``: sample i's ids are its bag, given
    to the EmbeddingBag as flat ids with offsets (Opacus's input form)."""

    def __init__(self, vocab: int, width: int, mode: str):
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab, width, mode=mode)

    def forward(self, rows: PackedRows) -> Tensor:
        counts = torch.bincount(rows.sample_index, minlength=rows.num_samples)  # (N,)
        return self.bag(rows.data, counts.cumsum(0) - counts)  # (N, width)


@st.composite
def bag_configs(draw):
    """Opacus's EmbeddingBag space: 4-8 bags of 1-sz distinct ids, sum or mean."""
    torch.manual_seed(draw(st.integers(0, 2**16)))
    n, most = draw(st.integers(4, 8)), draw(st.integers(3, 7))
    vocab, width = draw(st.integers(10, 32)), draw(st.integers(10, 17))
    sizes = torch.randint(1, most + 1, (n,))
    ids = torch.cat([torch.randperm(vocab)[:s] for s in sizes.tolist()])  # (R,)
    rows = PackedRows(ids, torch.arange(n).repeat_interleave(sizes), n)
    return Bags(vocab, width, draw(st.sampled_from(["sum", "mean"]))), rows


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@HYPOTHESIS
@given(config=bag_configs())
def test_opacus_embedding_bag_configurations(reduction, config):
    """Drawn bags of distinct ids, as PackedRows (the loop gives each sample its bag)."""
    model, rows = config
    check_against_loop(model.double(), rows, None, l1(reduction))


# ---------------------------------------------------------------------------
# 3. BackPACK: the batch_grad problems


def frozen(layer: nn.Module) -> nn.Module:
    return layer.requires_grad_(False)


def simple_cnn(conv: nn.Module, shape: tuple[int, ...]) -> nn.Module:
    """BackPACK's simple CNN: the convolution, ReLU, Flatten and a frozen Linear to 5."""
    width = conv(torch.zeros(shape)).numel() // shape[0]
    return nn.Sequential(conv, nn.ReLU(), nn.Flatten(), frozen(nn.Linear(width, 5)))


def batch_norm_eval(model: nn.Module) -> nn.Module:
    """Every BatchNorm with random running statistics and affine parameters, eval mode."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(0, 1)
            m.running_var.uniform_(0, 1)
            nn.init.uniform_(m.weight)
            nn.init.uniform_(m.bias)
    return model.eval()


class First(nn.Module):
    """The first element of a recurrent layer's output tuple, optionally permuted."""

    def __init__(self, *dims: int):
        super().__init__()
        self.dims = dims

    def forward(self, out: tuple) -> Tensor:
        return out[0].permute(*self.dims) if self.dims else out[0]


def resnet18() -> nn.Module:
    return require("torchvision").models.resnet18(num_classes=4).eval()


def ce(reduction: str = "mean") -> nn.Module:
    return nn.CrossEntropyLoss(reduction=reduction)


def mse(reduction: str = "mean") -> nn.Module:
    return nn.MSELoss(reduction=reduction)


def classes(shape: tuple[int, ...], n: int) -> Callable[[], Tensor]:
    return lambda: torch.randint(0, n, shape)


def reals(shape: tuple[int, ...]) -> Callable[[], Tensor]:
    return lambda: torch.rand(shape)


def rand(*shape: int) -> Callable[[], Tensor]:
    return lambda: torch.rand(shape)


def conv_problems() -> list[tuple]:
    """BackPACK's convolution settings: ``(input shape, layer class, its arguments)``."""
    table = [
        ((3, 3, 7), nn.Conv1d, (3, 2, 2)),
        ((3, 2, 7), nn.Conv1d, (2, 3, 2, 2, 0, 2)),
        ((3, 3, 7), nn.Conv1d, (3, 2, 2, 2, 1)),
        ((3, 3, 8), nn.Conv1d, (3, 6, 2, 4, 2, 3)),
        ((3, 3, 7), nn.Conv1d, (3, 2, 2, 4, 2, 1, 1, False)),
        ((3, 3, 7, 7), nn.Conv2d, (3, 2, 2)),
        ((3, 2, 7, 7), nn.Conv2d, (2, 3, 2, 2, 0, 2)),
        ((3, 3, 7, 7), nn.Conv2d, (3, 2, 2, 2, 1)),
        ((3, 3, 8, 8), nn.Conv2d, (3, 6, 2, 4, 2, 3)),
        ((3, 3, 7, 7), nn.Conv2d, (3, 2, 2, 4, 2, 1, 1, False)),
        ((3, 3, 2, 7, 7), nn.Conv3d, (3, 2, 2)),
        ((3, 2, 3, 7, 7), nn.Conv3d, (2, 3, 2, 2, 0, 2)),
        ((3, 3, 2, 7, 7), nn.Conv3d, (3, 2, 2, 3, 2)),
        ((3, 3, 4, 8, 8), nn.Conv3d, (3, 6, 2, 4, 2, 3)),
        ((3, 3, 2, 7, 7), nn.Conv3d, (3, 2, 2, 4, 2, 1, 1, False)),
        ((3, 3, 7), nn.ConvTranspose1d, (3, 2, 2)),
        ((3, 2, 7), nn.ConvTranspose1d, (2, 3, 2, 2, 0, 0, 1, True, 2)),
        ((3, 3, 7), nn.ConvTranspose1d, (3, 2, 2, 2, 1)),
        ((3, 3, 8), nn.ConvTranspose1d, (3, 6, 2, 4, 2, 0, 1, True, 3)),
        ((3, 3, 7), nn.ConvTranspose1d, (3, 2, 2, 4, 2, 0, 1, False)),
        ((3, 3, 7, 7), nn.ConvTranspose2d, (3, 2, 2)),
        ((3, 2, 9, 9), nn.ConvTranspose2d, (2, 4, 2, 1, 0, 0, 1, True, 2)),
        ((3, 3, 7, 7), nn.ConvTranspose2d, (3, 2, 2, 2, 1)),
        ((3, 3, 7, 7), nn.ConvTranspose2d, (3, 2, 2, 4, 2, 0, 1, False)),
        ((3, 3, 2, 7, 7), nn.ConvTranspose3d, (3, 2, 2)),
        ((3, 2, 3, 5, 5), nn.ConvTranspose3d, (2, 3, 2, 2, 2, 0, 1, True, 2)),
        ((3, 3, 2, 7, 7), nn.ConvTranspose3d, (3, 2, 2, 4, 2, 0, 1, False)),
    ]
    return [(f"{cls.__name__}{args}",
             (lambda s=shape, c=cls, a=args: simple_cnn(c(*a), s)),
             rand(*shape), classes((3,), 5), lambda: ce("sum"))
            for shape, cls, args in table]


# (id, model, input, target, loss): each made after torch.manual_seed(0)
BACKPACK_PROBLEMS = [
    ("linear", lambda: nn.Sequential(nn.Linear(10, 5)), rand(3, 10), classes((3,), 5),
     lambda: ce("sum")),
    ("linear-linear", lambda: nn.Sequential(nn.Linear(10, 7), nn.Linear(7, 5)), rand(3, 10),
     classes((3,), 5), ce),
    ("linear-relu-linear", lambda: nn.Sequential(nn.Linear(10, 7), nn.ReLU(), nn.Linear(7, 5)),
     rand(3, 10), classes((3,), 5), lambda: ce("sum")),
    ("linear-sigmoid-linear-mse",
     lambda: nn.Sequential(nn.Linear(10, 7), nn.Sigmoid(), nn.Linear(7, 5)), rand(3, 10),
     reals((3, 5)), mse),
    ("one-additional-mse", lambda: nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2)),
     rand(3, 4, 5), reals((3, 4, 2)), mse),
    ("two-additional-mse", lambda: nn.Sequential(nn.Linear(5, 3), nn.Sigmoid(), nn.Linear(3, 2)),
     rand(3, 4, 2, 5), reals((3, 4, 2, 2)), mse),
    ("three-additional-mse", lambda: nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2)),
     rand(3, 4, 2, 3, 5), reals((3, 4, 2, 3, 2)), lambda: mse("sum")),
    ("one-additional-ce", lambda: nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2), nn.Flatten()),
     rand(3, 4, 5), classes((3,), 8), ce),
    ("two-additional-ce",
     lambda: nn.Sequential(nn.Linear(5, 3), nn.Sigmoid(), nn.Linear(3, 2), nn.Flatten()),
     rand(3, 4, 2, 5), classes((3,), 16), ce),
    ("three-additional-ce",
     lambda: nn.Sequential(nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 2), nn.Flatten()),
     rand(3, 4, 2, 3, 5), classes((3,), 48), lambda: ce("sum")),
    *conv_problems(),
    ("batchnorm1d-eval", lambda: batch_norm_eval(nn.BatchNorm1d(3)), rand(2, 3, 4),
     classes((2, 4), 3), ce),
    ("batchnorm2d-eval", lambda: batch_norm_eval(nn.BatchNorm2d(2)), rand(3, 2, 4, 3),
     classes((3, 4, 3), 2), ce),
    ("batchnorm3d-eval", lambda: batch_norm_eval(nn.BatchNorm3d(3)), rand(3, 3, 4, 1, 2),
     classes((3, 4, 1, 2), 3), ce),
    ("batchnorm3d-linear-eval",
     lambda: batch_norm_eval(nn.Sequential(nn.BatchNorm3d(3), nn.Linear(2, 3), nn.BatchNorm3d(3),
                                           nn.ReLU(), nn.BatchNorm3d(3))),
     rand(3, 3, 4, 1, 2), classes((3, 4, 1, 3), 3), ce),
    ("rnn-ce", lambda: nn.Sequential(nn.RNN(6, 3, batch_first=True), First(0, 2, 1)),
     rand(8, 5, 6), classes((8, 5), 3), ce),
    ("rnn-mse", lambda: nn.Sequential(nn.RNN(6, 3, batch_first=True), First(0, 2, 1),
                                      nn.Flatten()),
     rand(8, 5, 6), reals((8, 15)), mse),
    ("lstm-ce", lambda: nn.Sequential(nn.LSTM(3, 4, batch_first=True), First(), nn.Flatten()),
     rand(4, 5, 3), classes((4,), 20), ce),
    ("embedding-1d", lambda: nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 4)),
     lambda: torch.randint(0, 5, (6,)), classes((6,), 4), ce),
    ("embedding-3d", lambda: nn.Sequential(nn.Embedding(3, 5), nn.Flatten()),
     lambda: torch.randint(0, 3, (4, 2, 2)), classes((4,), 10), ce),
    ("resnet18-eval", resnet18, rand(2, 3, 7, 7), reals((2, 4)), mse),
]


@pytest.mark.parametrize("problem", BACKPACK_PROBLEMS, ids=[p[0] for p in BACKPACK_PROBLEMS])
def test_backpack_batch_grad_problems(problem):
    """One of BackPACK's problems, as its settings build it, in float64."""
    _, make_model, make_input, make_target, make_loss = problem
    torch.manual_seed(0)
    model, x, y = make_model().double(), make_input(), make_target()
    x = x.double() if x.is_floating_point() else x
    y = y.double() if y.is_floating_point() else y
    check_against_loop(model, x, y, make_loss())
