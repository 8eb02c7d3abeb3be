"""`persample bench`'s real-size transformers (GPT-2 small with its 50257 vocabulary, BERT
and Llama with LoRA), built at their tiny test size: every row of the table against the
reference, persample exact against the loop in float64 on the rules, the properties the
workloads claim (checked on the full-size models built on the meta device: no memory, no
time), the memory estimate that skips a competitor, the comparison of gigabyte results
without copies, and the rounds of slow calls.

The tiny size keeps everything but the widths: the same vocabulary, text, loss, adapters
and trainable parameters; batch = sequence length = heads = 4 (BERT's sequence 16, so
that its samples have their own lengths).
"""

from __future__ import annotations

import functools
import importlib.util
import warnings

import pytest
import torch

import persample
from cases import assert_exact
from persample.dp import private_grad
from persample_bench import anchors, bench
from persample_bench.anchors import memory
from persample_bench.workloads import (
    REAL_GRAD_WORKLOADS,
    REAL_WORKLOADS,
    SMALL_WORKLOADS,
    WORKLOADS,
    real_workload,
)
from zoo import require

PERSAMPLE_ROWS = {"persample", "persample (flat=True)", "persample (out=)"}
ENGINE = "persample PrivacyEngine (Opacus loop)"  # a DP step as an Opacus script runs it
HAS_OPACUS = importlib.util.find_spec("opacus") is not None

# rows that run and agree with the reference here (Opacus's where it is installed)
MUST_AGREE = {
    "gpt2-768-grads": {"loop", "torch.func vmap", "Opacus hooks"} | PERSAMPLE_ROWS,
    "gpt2-768-dp-step": {"loop + clipping", "torch.func vmap + clipping", "Opacus hooks",
                         "persample", ENGINE},
    "bert-lora-grads": {"loop", "Opacus hooks", "persample"},
    "bert-lora-dp-step": {"loop + clipping", "Opacus hooks", "Opacus ghost clipping",
                          "persample", ENGINE},
    "llama-lora-grads": {"loop", "torch.func vmap", "Opacus hooks", "persample"},
    "llama-lora-dp-step": {"loop + clipping", "torch.func vmap + clipping", "Opacus hooks",
                           "Opacus ghost clipping", "persample", ENGINE},
    "gpt2-768-bf16-dp-step": {"loop + clipping", "torch.func vmap + clipping", "persample",
                              ENGINE},
    "gpt2-768-project": {"loop", "torch.func vmap", "persample per_sample_grads, then project",
                         "persample"},
    "gpt2-768-kfac-factors": {"by hand (module hooks)", "persample"},
}


@pytest.fixture(autouse=True)
def packages():
    require("transformers")
    require("peft")


@functools.cache
def full_size(name: str, device: str = "cpu"):
    """The full-size workload with its model on the meta device (its data real)."""
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return real_workload(name, device=device)


def trainable(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.keep_default_dtype  # the benchmark's workloads are float32
@pytest.mark.parametrize("name", REAL_WORKLOADS)
def test_every_row_agrees_with_the_reference(name):
    case = bench.build_case(name, None, "cpu", size="tiny")
    assert case.workload.dtype == torch.float32
    report = bench.bench_case(case, True, lambda label: None)
    by_name = {m.method: m for m in report.methods}
    assert report.ours == "persample" and report.reference == case.reference_label
    want_ok = {m for m in MUST_AGREE[name] if HAS_OPACUS or not m.startswith("Opacus")}
    for m in report.methods:
        if m.method in want_ok or m.status == "ok":
            assert m.status == "ok" and m.agrees, m
            bound = 2e-3 if case.workload.autocast else 1e-5  # bf16: rounding of the loop
            assert m.max_abs_diff <= bound and m.median_ms > 0, m
        else:  # a competitor that cannot run here says why
            assert m.status.startswith(("not installed", "not applicable", "failed")), m
    layout = {"persample (flat=True)", "persample (out=)"}  # only where results are large
    assert bool(layout & set(by_name)) == (name == "gpt2-768-grads")
    assert report.result_shape == list(case.result_shape)


def test_opacus_refuses_ghost_clipping_of_tied_weights_and_says_so():
    """GPT-2's output layer is its token embedding: Opacus's ghost clipping refuses
    it, and the row says so instead of a wrong result."""
    if not HAS_OPACUS:
        pytest.skip("opacus is not installed")
    case = bench.build_case("gpt2-768-dp-step", None, "cpu", size="tiny")
    ghost = next(m for m in case.methods if m.name == "Opacus ghost clipping")
    with pytest.raises(NotImplementedError, match="tying"):
        ghost.fn(None)


@pytest.mark.parametrize("name", REAL_GRAD_WORKLOADS)
def test_persample_exact_on_the_rules_in_float64(name, snapshot):
    w = real_workload(name, size="tiny")
    model = w.model.double()
    state = snapshot(model)
    routes = persample.supported(model, w.inputs, w.targets, w.loss_fn)
    assert {r.path for r in routes} == {"rule"}, routes
    assert {f"{r.module}.{p}" for r in routes for p in r.params} == set(trainable(model))
    want = persample.loop_per_sample_grads(model, w.inputs, w.targets, w.loss_fn)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*Falling back")  # no fallback taken
        got = persample.per_sample_grads(model, w.inputs, w.targets, w.loss_fn)
        assert_exact(got, want)
        assert all(g.abs().max() > 0 for g in want.values())  # every gradient is checked
        # one DP-SGD step without noise: each sample's gradient clipped to C, summed, / B
        norms = sum(g.flatten(1).pow(2).sum(1) for g in want.values()).sqrt()
        scale = (1.0 / (norms + 1e-6)).clamp(max=1.0)  # C = 1
        clipped = {n: torch.tensordot(scale, g, dims=1) / w.n for n, g in want.items()}
        _, got_norms = private_grad(model, w.inputs, w.targets, w.loss_fn, max_grad_norm=1.0,
                                    noise_multiplier=0.0)
    assert_exact({"norms": got_norms}, {"norms": norms})
    assert_exact({n: p.grad for n, p in trainable(model).items()}, clipped)
    for p in model.parameters():
        p.grad = None
    state.assert_unchanged()


def test_gpt2_768_is_gpt2_small_with_its_tied_vocabulary():
    cpu, gpu = full_size("gpt2-768-grads"), full_size("gpt2-768-grads", "cuda")
    for w, layers in ((cpu, 4), (gpu, 12)):
        config = w.model.config
        assert (config.vocab_size, config.n_embd, config.n_head, config.n_layer) == (
            50257, 768, 12, layers)
        assert w.model.lm_head.weight is w.model.transformer.wte.weight  # tied, as shipped
        assert all(p.requires_grad for p in w.model.parameters())
        assert "12 with --device cuda" in cpu.description and "12 layers" in gpu.description
    assert anchors.num_params(cpu.model) == 67_736_832
    ids = cpu.inputs["input_ids"]
    assert ids.shape == (8, 128) and bool((cpu.inputs["attention_mask"] == 1).all())
    # text hashed over the whole vocabulary, documents ended by <|endoftext|>
    assert ids.max() < 50257 and ids.unique().numel() > 300 and (ids > 40000).any()
    assert (ids == 50256).sum() >= 2
    positions = cpu.opacus_inputs["position_ids"]
    assert positions.shape == ids.shape and bool((positions == torch.arange(128)).all())
    tiny = real_workload("gpt2-768-grads", size="tiny")
    assert tiny.model.lm_head.weight is tiny.model.transformer.wte.weight
    assert tiny.model.config.vocab_size == 50257 and tiny.n == 4


def test_bert_lora_pads_its_samples_and_trains_adapters_and_classifier_only():
    w = full_size("bert-lora-grads")
    config = w.model.config
    assert (config.vocab_size, config.hidden_size, config.num_attention_heads,
            config.num_hidden_layers, config.num_labels) == (30522, 768, 12, 4, 2)
    mask, ids = w.inputs["attention_mask"], w.inputs["input_ids"]
    assert ids.shape == (16, 128) and w.targets.shape == (16,)
    lengths = mask.sum(1)
    assert lengths.min() < 128 and lengths.unique().numel() > 8  # padded, lengths vary
    assert bool((ids[mask == 0] == 0).all()) and bool((ids[:, 0] == 101).all())  # [PAD], [CLS]
    assert set(w.targets.tolist()) == {0, 1}
    assert w.opacus_inputs["position_ids"].shape == w.opacus_inputs["token_type_ids"].shape \
        == ids.shape
    names = list(trainable(w.model))
    adapters = [n for n in names if "lora_" in n]
    assert len(adapters) == 4 * 2 * 2  # lora_A and lora_B on query and value, 4 layers
    assert all(".query." in n or ".value." in n for n in adapters)
    heads = [n for n in names if "lora_" not in n]
    assert heads and all("classifier.modules_to_save" in n for n in heads), heads
    assert anchors.num_params(w.model) == 4 * 2 * (8 * 768 * 2) + 768 * 2 + 2
    assert "padded" in w.description


def test_llama_lora_has_grouped_query_attention_and_adapters_on_q_k_v_o():
    w = full_size("llama-lora-grads")
    config = w.model.config
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers,
            config.intermediate_size) == (32000, 1024, 4, 2816)
    assert (config.num_attention_heads, config.num_key_value_heads) == (16, 4)  # GQA
    base = w.model.base_model.model
    attention = base.model.layers[0].self_attn
    assert attention.k_proj.base_layer.out_features == 1024 // 16 * 4
    assert type(base.model.norm).__name__ == "LlamaRMSNorm"
    assert base.lm_head.weight is not base.model.embed_tokens.weight  # not tied
    names = list(trainable(w.model))
    assert len(names) == 4 * 4 * 2 and all("lora_" in n for n in names)
    assert {n.split(".")[-4] for n in names} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert anchors.num_params(w.model) == 4 * (2 * 16 * (1024 + 1024) + 2 * 16 * (1024 + 256))
    ids = w.inputs["input_ids"]
    assert ids.shape == (8, 128) and ids.max() < 32000 and (ids == 1).any()  # <s> begins docs


def test_memory_estimate_skips_competitors_and_refuses_a_reference_that_cannot_fit(
        monkeypatch):
    w = real_workload("llama-lora-grads", size="tiny")
    estimate = anchors.memory_estimate(w)
    assert estimate.result == 4 * anchors.num_params(w.model) * 4
    needs = {m: estimate.need(m) for m in ("loop", "torch.func vmap", "Opacus hooks")}
    assert needs["loop"] < needs["Opacus hooks"] < needs["torch.func vmap"]
    monkeypatch.setattr(memory, "MEMORY_LIMIT_BYTES", needs["loop"] * 1.01)
    case = anchors.grads_case(w)
    by_name = {m.name: m for m in case.methods}
    for name in ("torch.func vmap", "Opacus hooks"):
        assert by_name[name].fn is None
        assert by_name[name].note.startswith("skipped: would need about"), by_name[name]
    assert by_name["loop"].fn is not None and by_name["persample"].fn is not None
    monkeypatch.setattr(memory, "MEMORY_LIMIT_BYTES", needs["loop"] / 2)
    with pytest.raises(MemoryError, match="llama-lora-grads: the loop, the reference, would"):
        anchors.dp_step_case(w)


def test_results_are_compared_with_the_reference_in_slices(monkeypatch):
    monkeypatch.setattr(bench, "CHUNK_NUMEL", 5)  # several slices per entry
    g = torch.Generator().manual_seed(0)
    result = {"w": torch.randn(3, 4, 2, generator=g), "b": torch.randn(3, 2, generator=g)}
    reference = bench.as_flat(result, (3, 10)).clone()
    assert bench.max_abs_diff(result, reference) == 0.0
    reference[2, 9] += 0.5  # the last entry of the last row
    assert bench.max_abs_diff(result, reference) == pytest.approx(0.5)
    assert bench.max_abs_diff(reference.flatten(), reference.flatten() + 1) == 1.0
    with pytest.raises(ValueError, match="'b'"):
        bench.max_abs_diff({"w": result["w"], "b": result["b"][:1]}, reference)
    with pytest.raises(RuntimeError, match="9 numbers per row"):
        bench.max_abs_diff({"w": result["w"], "b": result["b"][:, :1]}, reference)


def test_slow_calls_join_fewer_rounds():
    assert bench._rounds(0.5, 7) == 7
    assert bench._rounds(bench.SLOW_S + 0.1, 7) == 3
    assert bench._rounds(bench.VERY_SLOW_S + 0.1, 7) == 1


@pytest.mark.keep_default_dtype
def test_very_slow_baseline_and_methods_are_timed_in_one_round(monkeypatch):
    """Every call is made very slow: the baseline warms up once (no second warm-up) and
    joins one round, and every method its first (checked) call and one round."""
    monkeypatch.setattr(bench, "SLOW_S", 0.0)
    monkeypatch.setattr(bench, "VERY_SLOW_S", 0.0)
    rounds = 1
    case = bench.build_case("llama-lora-grads", None, "cpu", size="tiny")
    calls, base = [], case.base
    case.base = lambda: (calls.append(1), base())
    report = bench.bench_case(case, False, lambda label: None)
    assert len(calls) == 1 + rounds
    for m in report.methods:
        assert m.status != "ok" or len(m.times_ms) == rounds, m


def test_workload_groups_and_sizes():
    assert set(SMALL_WORKLOADS).isdisjoint(REAL_WORKLOADS)
    assert WORKLOADS == SMALL_WORKLOADS + REAL_WORKLOADS
    assert REAL_WORKLOADS == ("gpt2-768-grads", "gpt2-768-dp-step", "bert-lora-grads",
                              "bert-lora-dp-step", "llama-lora-grads", "llama-lora-dp-step",
                              "gpt2-768-bf16-dp-step", "gpt2-768-project",
                              "gpt2-768-kfac-factors")
    with pytest.raises(ValueError, match="one size"):
        bench.build_case("cnn-grads", 2, "cpu", size="tiny")
    with pytest.raises(ValueError, match="unknown size"):
        real_workload("gpt2-768-grads", size="small")


@pytest.mark.parametrize(("name", "only", "built"), [
    ("llama-lora-grads", "persample", ["loop", "persample"]),
    ("llama-lora-dp-step", "persample", ["persample"]),
    ("gpt2-768-project", "persample", ["loop", "persample per_sample_grads, then project",
                                       "persample"]),
    ("gpt2-768-project", "torch.func vmap", ["loop", "torch.func vmap",
                                             "persample per_sample_grads, then project",
                                             "persample"])])
def test_a_memory_probe_builds_only_its_row(name, only, built):
    """The rows no probe asked for are not built (no model copies, no Opacus), except
    the loop and persample's rows of a gradients case, which build nothing."""
    case = bench.build_case(name, None, "cpu", size="tiny", only=only)
    assert [m.name for m in case.methods if m.fn is not None] == built
    for m in case.methods:
        if m.fn is None:
            assert m.note.startswith("not built: only "), m
