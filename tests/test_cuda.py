"""The same computations on a GPU (run where one is present; a CPU-only machine runs
the rest of the suite): every result against the loop in float64, nothing of the hot
path assuming the CPU (the result pool, parallel noise, the conv cost model)."""

import pytest
import torch
from torch import nn

import persample
from persample import memory
from persample.dp import private_grad
from persample.rules.conv import conv_weight_per_sample
from zoo import ZOO

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")


def _to(tree, device):
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: _to(v, device) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(_to(v, device) for v in tree)
    return tree


@pytest.mark.parametrize("name", ["gpt2-lm", "resnet18", "timm-vit-layerscale", "llama-lora"])
def test_real_models_on_the_gpu_match_the_loop(name):
    if name not in ZOO:
        pytest.fail(f"{name} is not in the zoo: {sorted(ZOO)}")
    model, inputs, targets, loss_fn = ZOO[name]()
    model, inputs, targets = model.to(CUDA), _to(inputs, CUDA), _to(targets, CUDA)
    got = persample.per_sample_grads(model, inputs, targets, loss_fn, method="rules")
    want = persample.loop_per_sample_grads(model, inputs, targets, loss_fn)
    for key, g in got.items():
        assert g.device.type == "cuda" and g.is_contiguous()
        torch.testing.assert_close(g, want[key], rtol=1e-8, atol=1e-11)


def test_results_on_the_gpu_do_not_use_the_host_pool():
    net = nn.Sequential(nn.Linear(50, 600), nn.Tanh(), nn.Linear(600, 600)).to(CUDA)
    x, y = torch.randn(8, 50, device=CUDA), torch.randn(8, 600, device=CUDA)
    persample.empty_cache()
    flat = persample.per_sample_grads(net, x, y, nn.MSELoss(), flat=True)
    assert flat.device.type == "cuda" and flat.is_contiguous()
    del flat
    assert not memory._POOL.free


def test_private_grad_on_the_gpu():
    net = nn.Sequential(nn.Linear(4, 600), nn.Tanh(), nn.Linear(600, 3000)).to(CUDA)
    x, y = torch.randn(6, 4, device=CUDA), torch.randn(6, 3000, device=CUDA)
    gen = torch.Generator(device=CUDA).manual_seed(0)
    private_grad(net, x, y, nn.MSELoss(), max_grad_norm=1.0, noise_multiplier=1.0,
                 generator=gen)
    assert all(p.grad.device.type == "cuda" and torch.isfinite(p.grad).all()
               for p in net.parameters())
    private_grad(net, x, y, nn.MSELoss(), max_grad_norm=1e-3, noise_multiplier=0.0)
    grads = persample.loop_per_sample_grads(net, x, y, nn.MSELoss())
    norms = torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1)
    factor = (1e-3 / (norms + 1e-6)).clamp(max=1.0)
    for (name, p) in net.named_parameters():
        want = torch.tensordot(factor, grads[name], dims=1) / 6
        torch.testing.assert_close(p.grad, want, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("method", ["patches", "grouped"])
def test_conv_methods_on_the_gpu(method):
    x = torch.randn(4, 1, 8, 6, 6, device=CUDA)
    weight = torch.randn(16, 8, 3, 3, device=CUDA)
    out = torch.nn.functional.conv2d(x[:, 0], weight, padding=1)
    g = torch.randn(4, 1, 1, *out.shape[1:], device=CUDA)
    dst = torch.empty(4, 1, *weight.shape, device=CUDA)
    conv_weight_per_sample(x, g, weight.shape, 1, 1, 1, 1, dst, method)
    for i in range(4):
        w = weight.clone().requires_grad_()
        o = torch.nn.functional.conv2d(x[i], w, padding=1)
        torch.testing.assert_close(dst[i, 0], torch.autograd.grad(o, w, g[i, 0])[0],
                                   rtol=1e-8, atol=1e-11)


class _LastRow(nn.Module):
    """An LSTM read at its last step, then a linear head."""

    def __init__(self):
        super().__init__()
        self.lstm, self.head = nn.LSTM(6, 16, batch_first=True), nn.Linear(16, 5)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


def _captured(call):
    """``call()`` run on a side stream until its plan settles, then captured in a CUDA
    graph: ``(graph, its outputs)``, as torch's guide to CUDA graphs warms up and
    captures a training step."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(6):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out


@pytest.mark.parametrize("kind", ["mlp", "lstm"])
def test_per_sample_grads_captured_in_a_cuda_graph_match_the_loop(kind):
    """A steady-state call reads no value on the host, so a CUDA graph captures it whole:
    each replay, on new inputs copied into the captured ones and parameters moved in place
    (an optimizer's step), gives the loop's per-sample gradients of that batch."""
    torch.manual_seed(0)
    net = (nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 5)) if kind == "mlp"
           else _LastRow()).double().to(CUDA)
    shape = (8, 12) if kind == "mlp" else (8, 7, 6)
    x = torch.randn(*shape, device=CUDA, dtype=torch.float64)
    y = torch.randint(0, 5, (8,), device=CUDA)
    loss_fn = nn.CrossEntropyLoss()
    graph, grads = _captured(lambda: persample.per_sample_grads(net, x, y, loss_fn))
    for _ in range(3):
        new_x, new_y = torch.randn_like(x), torch.randint(0, 5, (8,), device=CUDA)
        x.copy_(new_x)
        y.copy_(new_y)
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p), alpha=0.01)
        graph.replay()
        want = persample.loop_per_sample_grads(net, new_x, new_y, loss_fn)
        assert set(grads) == set(want)
        for key, g in grads.items():
            torch.testing.assert_close(g, want[key], rtol=1e-8, atol=1e-11)


def test_a_dp_step_refuses_to_be_captured_by_name():
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(CUDA)
    x, y = torch.randn(6, 4, device=CUDA), torch.randint(0, 3, (6,), device=CUDA)

    def step():
        private_grad(net, x, y, nn.CrossEntropyLoss(), max_grad_norm=1.0, noise_multiplier=1.0)

    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        _captured(step)


@pytest.mark.parametrize("kind", ["mlp", "lstm"])
def test_graphed_replays_match_the_loop_and_a_changed_model_is_captured_again(kind):
    torch.manual_seed(0)
    net = (nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 5)) if kind == "mlp"
           else _LastRow()).double().to(CUDA)
    shape = (8, 12) if kind == "mlp" else (8, 7, 6)
    loss_fn = nn.CrossEntropyLoss()
    step = persample.graphed(persample.per_sample_grads, net, loss_fn=loss_fn)
    for k in range(4):
        if k == 2:  # a new parameter tensor: the graph read the old one
            head = net[2] if kind == "mlp" else net.head
            head.weight = nn.Parameter(torch.randn_like(head.weight))
        x = torch.randn(*shape, device=CUDA, dtype=torch.float64)
        y = torch.randint(0, 5, (8,), device=CUDA)
        got = step(x, y)
        want = persample.loop_per_sample_grads(net, x, y, loss_fn)
        assert set(got) == set(want)
        for key, g in got.items():
            torch.testing.assert_close(g, want[key], rtol=1e-8, atol=1e-11)
    assert step.captures == 2

