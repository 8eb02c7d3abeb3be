"""PrivateTrainer: DP-SGD inside the Hugging Face Trainer, against PrivateStep by hand.

Tiny BERT classifier and GPT-2 (with and without LoRA) on the standard library's
docstrings (persample.cli.data.docstring_examples), in float64. The Trainer's batches
are recorded by the collator; the same micro-batches accumulated into a PrivateStep
by hand, released and stepped with the same optimizer give the same parameters.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from persample.cli.data import docstring_examples
from persample.dp import PoissonBatchSampler, PrivacyAccountant, PrivateStep
from persample.dp.noise import SecureSource
from zoo import require

transformers = require("transformers")
from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    TrainingArguments,
    default_data_collator,
)

from persample.integrations.transformers import (  # noqa: E402
    PRIVACY_STATE,
    PrivacyArguments,
    PrivateTrainer,
    default_per_sample_loss,
)

pytestmark = pytest.mark.slow  # training runs, and torchrun's processes
SEED = 3


# dropout 0: the Trainer trains in train mode, and the update by hand must see the same model
def bert(num_labels: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=257, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, num_labels=num_labels, max_position_embeddings=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).double()


def gpt2(lora: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=257, n_positions=32, n_embd=16, n_layer=1, n_head=2, bos_token_id=256,
        eos_token_id=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).double()
    if lora:
        peft = require("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=2, lora_alpha=4, target_modules=["c_attn"], fan_in_fan_out=True,
            task_type="CAUSAL_LM"))
    return model


class Recording:
    """The Trainer's collator, recording each micro-batch's examples."""

    def __init__(self):
        self.batches: list[list[dict]] = []

    def __call__(self, examples: list[dict]) -> dict:
        self.batches.append(examples)
        return default_data_collator(examples)


def args(tmp_path, **kw) -> TrainingArguments:
    base = dict(per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=3,
                use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
                logging_steps=1, seed=SEED)
    return TrainingArguments(str(tmp_path / "out"), **{**base, **kw})


def _keys(examples: list[dict]) -> list[tuple]:
    return [(tuple(e["input_ids"].tolist()), e["labels"].tolist()) for e in examples]


def sgd(model: nn.Module, lr: float = 0.5):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)


def drawn(data: list, expected: int, steps: int) -> list[list[dict]]:
    """The micro-batches PrivateTrainer trains on: the seeded Poisson sampler's logical
    batches, each split in two (the first half, then the rest)."""
    n = len(data)
    draws = iter(PoissonBatchSampler(n, expected / n, round(n / expected),
                                     torch.Generator().manual_seed(SEED)))
    micro = []
    for _ in range(steps):
        logical = next(draws)
        half = len(logical) // 2
        micro += [[data[i] for i in logical[:half]], [data[i] for i in logical[half:]]]
    return micro


def by_hand(model: nn.Module, micro: list[list[dict]], parts: int, expected: int, q: float,
            loss_fn, privacy: PrivacyArguments) -> PrivateStep:
    """The same micro-batches through PrivateStep, released every ``parts``."""
    opt, _ = sgd(model)
    step = PrivateStep(model, loss_fn, max_grad_norm=privacy.max_grad_norm,
                       noise_multiplier=privacy.noise_multiplier,
                       expected_batch_size=expected, sample_rate=q,
                       per_layer=privacy.per_layer, param_groups=privacy.param_groups,
                       automatic_gamma=privacy.automatic_gamma)
    step.logical_losses = [0.0]  # each logical batch's summed per-sample losses
    for k, examples in enumerate(micro):
        if examples:
            batch = default_data_collator(examples)
            features = {key: v for key, v in batch.items() if key != "labels"}
            step.logical_losses[-1] += float(step.accumulate(features, batch).losses.sum())
        if (k + 1) % parts == 0:
            step.logical_losses.append(0.0)
            step.release()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return step


@pytest.mark.parametrize("which", ["bert", "gpt2", "gpt2-lora"])
def test_same_update_as_private_step_by_hand(tmp_path, which):
    """Noise 0, the same batches: the Trainer's parameters after 3 logical steps of
    2 micro-batches are PrivateStep's by hand, to float64 rounding; the batches are the
    seeded Poisson sampler's, each logical batch split in two."""
    make = {"bert": bert, "gpt2": gpt2, "gpt2-lora": lambda: gpt2(lora=True)}[which]
    data = (docstring_examples("module", seq_len=16) if which == "bert"
            else docstring_examples("causal", seq_len=16, count=48))
    privacy = PrivacyArguments(noise_multiplier=0.0, max_grad_norm=0.05, seed=SEED)
    model, collate = make(), Recording()
    trainer = PrivateTrainer(model, args(tmp_path), train_dataset=data,
                             data_collator=collate, optimizers=sgd(model),
                             privacy_args=privacy)
    trainer.train()
    expected, n = 16, len(data)
    q = expected / n
    micro = drawn(data, expected, 3)
    seen = [b for b in collate.batches if len(b) > 0]
    assert [_keys(b) for b in seen] == [_keys(b) for b in micro if b]

    reference = make()
    step = by_hand(reference, micro, 2, expected, q, default_per_sample_loss(reference),
                   privacy)
    changed = 0
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, r, rtol=1e-10, atol=1e-12, msg=name)
        changed += p.requires_grad
    assert changed and trainer.private_step.accountant.steps == step.accountant.steps == 3
    # the logged loss of each step: its per-sample losses summed over the expected size
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    want = [total / expected for total in step.logical_losses[:3]]
    assert logged == pytest.approx(want, abs=1e-4) and len(set(want)) == 3
    assert trainer.epsilon() == math.inf  # noise 0: no privacy, and it says so
    moved = [n for n, p in model.named_parameters()
             if p.requires_grad and not torch.equal(p, make().state_dict()[n])]
    assert moved  # the update is not nothing


@pytest.mark.parametrize("which", ["bert", "gpt2", "gpt2-lora"])
def test_trains_to_a_target_epsilon(tmp_path, which):
    """With a target epsilon: the noise multiplier for the planned steps, every step
    accounted, epsilon <= target, epsilon logged with each loss."""
    make = {"bert": bert, "gpt2": gpt2, "gpt2-lora": lambda: gpt2(lora=True)}[which]
    data = (docstring_examples("module", seq_len=16) if which == "bert"
            else docstring_examples("causal", seq_len=16, count=64))
    model = make()
    trainer = PrivateTrainer(model, args(tmp_path, max_steps=-1, num_train_epochs=1,
                                         learning_rate=1e-3),
                             train_dataset=data,
                             privacy_args=PrivacyArguments(target_epsilon=3.0,
                                                           target_delta=1e-4))
    out = trainer.train()
    planned = round(len(data) / 16)
    assert out.global_step == planned == trainer.private_step.accountant.steps
    by_hand = PrivacyAccountant()
    by_hand.step(trainer.noise_multiplier, 16 / len(data), planned)
    assert trainer.epsilon() == pytest.approx(by_hand.epsilon(1e-4))
    assert 2.9 < trainer.epsilon() <= 3.0
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == planned and all("epsilon" in h for h in logged)
    assert logged[-1]["epsilon"] == pytest.approx(trainer.epsilon())
    assert all(math.isfinite(h["loss"]) and h["loss"] > 0 for h in logged)


@pytest.mark.parametrize("clipping", ["groups", "automatic"])
def test_clipping_by_group_and_automatic(tmp_path, clipping):
    """The Trainer clips as PrivateStep by hand does, for groups (the embeddings against
    the rest) and automatic clipping."""
    data = docstring_examples("module", seq_len=16)
    names = [n for n, p in bert().named_parameters() if p.requires_grad]
    if clipping == "groups":
        emb = [n for n in names if "embeddings" in n]
        options = dict(max_grad_norm=[0.02, 0.05],
                       param_groups=[emb, [n for n in names if n not in emb]])
    else:
        options = dict(max_grad_norm="automatic", automatic_gamma=0.1)
    privacy = PrivacyArguments(noise_multiplier=0.0, seed=SEED, **options)
    model = bert()
    trainer = PrivateTrainer(model, args(tmp_path), train_dataset=data, optimizers=sgd(model),
                             privacy_args=privacy)
    trainer.train()
    reference = bert()
    by_hand(reference, drawn(data, 16, 3), 2, 16, 16 / len(data),
            default_per_sample_loss(reference), privacy)
    flat = bert()
    by_hand(flat, drawn(data, 16, 3), 2, 16, 16 / len(data), default_per_sample_loss(flat),
            PrivacyArguments(noise_multiplier=0.0, max_grad_norm=0.05))
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-10, atol=1e-12, msg=name)
    assert any(not torch.allclose(p, f) for p, f in zip(model.parameters(), flat.parameters()))
    with pytest.raises(ValueError, match="a list needs param_groups"):
        PrivacyArguments(noise_multiplier=1.0, max_grad_norm=[1.0, 2.0])


def test_user_level_dp(tmp_path):
    """A ``user_id`` field: users Poisson-sampled, each user's records whole in one
    micro-batch, at most 3 of them, the tag never reaching the model; the update is
    PrivateStep's by hand with the same micro-batches and users."""
    data = docstring_examples("module", seq_len=16)
    for i, e in enumerate(data):  # each example told apart by its first two tokens
        e["input_ids"] = torch.cat([torch.tensor([i % 256, i // 256]), e["input_ids"][2:]])
        e["user_id"] = torch.tensor(7 * (i % 60) + 1)
    privacy = PrivacyArguments(noise_multiplier=0.0, max_grad_norm=0.05, seed=SEED,
                               user_ids="user_id", records_per_user=3)
    model, collate = bert(), Recording()
    trainer = PrivateTrainer(model, args(tmp_path, per_device_train_batch_size=4),
                             train_dataset=data, data_collator=collate, optimizers=sgd(model),
                             privacy_args=privacy)
    trainer.train()
    assert trainer.private_step.sample_rate == 8 / 60  # over the 60 users
    micro = collate.batches  # the samples of each micro-batch, as the model gets them
    assert len(micro) == 6 and all("user_id" not in e for b in micro for e in b)
    user_of = {k: int(e["user_id"]) for k, e in zip(_keys(data), data)}
    assert len(user_of) == len(data)  # every example told apart by its text
    users_of = [[user_of[k] for k in _keys(b)] for b in micro]
    for k in range(0, 6, 2):  # a logical batch: users whole, at most 3 records each
        assert not set(users_of[k]) & set(users_of[k + 1])
        every = users_of[k] + users_of[k + 1]
        assert all(every.count(u) <= 3 for u in every)
    assert any(len(u) > len(set(u)) for u in users_of)  # users of several records
    reference = bert()
    opt, _ = sgd(reference)
    step = PrivateStep(reference, default_per_sample_loss(reference), max_grad_norm=0.05,
                       noise_multiplier=0.0, expected_batch_size=8)
    for k, examples in enumerate(micro):
        if examples:
            batch = default_data_collator(examples)
            features = {key: v for key, v in batch.items() if key != "labels"}
            step.accumulate(features, batch, torch.tensor(users_of[k]))
        if k % 2:
            step.release()
            opt.step()
            opt.zero_grad(set_to_none=True)
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-10, atol=1e-12, msg=name)


def test_default_loss_is_the_models_own_per_sample():
    """Each sample's default loss is the model's own loss on that sample alone: the
    causal LM's shifted tokens with -100 ignored, the classifier's cross-entropy (the
    causal LM's own loss is computed in float32, ours in the logits' float64)."""
    lm = gpt2()
    lm.config.loss_type = "ForCausalLM"
    batch = default_data_collator(docstring_examples("causal", seq_len=12, count=5))
    batch["labels"][1, 4:] = -100
    batch["labels"][2, :] = -100  # no labelled token: 0
    losses = default_per_sample_loss(lm)(lm(input_ids=batch["input_ids"]), batch)
    for i in (0, 1, 3):
        own = lm(input_ids=batch["input_ids"][i:i + 1], labels=batch["labels"][i:i + 1]).loss
        torch.testing.assert_close(losses[i], own.double(), rtol=1e-6, atol=0)
    assert losses[2] == 0
    clf = bert()
    batch = default_data_collator(docstring_examples("module", seq_len=12)[::40])
    losses = default_per_sample_loss(clf)(clf(input_ids=batch["input_ids"]), batch)
    for i in range(len(losses)):
        own = clf(input_ids=batch["input_ids"][i:i + 1], labels=batch["labels"][i:i + 1]).loss
        torch.testing.assert_close(losses[i], own, rtol=1e-12, atol=0)


def test_regression_and_multi_label_losses():
    """num_labels == 1: squared error; float multi-hot labels: binary cross-entropy."""
    reg = bert(num_labels=1)
    ids = torch.randint(0, 256, (3, 8))
    batch = {"input_ids": ids, "labels": torch.randn(3)}
    losses = default_per_sample_loss(reg)(reg(input_ids=ids), batch)
    for i in range(3):
        own = reg(input_ids=ids[i:i + 1], labels=batch["labels"][i:i + 1]).loss
        torch.testing.assert_close(losses[i], own)
    multi = bert(num_labels=3)
    batch = {"input_ids": ids, "labels": torch.tensor([[1.0, 0, 1], [0, 0, 0], [1, 1, 1]])}
    losses = default_per_sample_loss(multi)(multi(input_ids=ids), batch)
    for i in range(3):
        own = multi(input_ids=ids[i:i + 1], labels=batch["labels"][i:i + 1]).loss
        torch.testing.assert_close(losses[i], own)


def test_resume_continues_the_accounting(tmp_path):
    """A checkpoint holds the accountant's steps; resuming continues from them, and a
    checkpoint without them is refused rather than restarting epsilon at 0."""
    data = docstring_examples("module", seq_len=16)
    privacy = PrivacyArguments(noise_multiplier=1.0, seed=SEED)
    first = PrivateTrainer(bert(), args(tmp_path, save_strategy="steps", save_steps=2,
                                        max_steps=2),
                           train_dataset=data, privacy_args=privacy)
    first.train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert (checkpoint / PRIVACY_STATE).is_file()
    again = PrivateTrainer(bert(), args(tmp_path, max_steps=4), train_dataset=data,
                           privacy_args=privacy)
    again.train(resume_from_checkpoint=str(checkpoint))
    assert again.private_step.accountant.steps == 4
    assert again.epsilon() > first.epsilon()
    (checkpoint / PRIVACY_STATE).unlink()
    with pytest.raises(ValueError, match="epsilon would restart at 0"):
        PrivateTrainer(bert(), args(tmp_path, max_steps=4), train_dataset=data,
                       privacy_args=privacy).train(resume_from_checkpoint=str(checkpoint))


def test_args_left_as_given_and_refusals(tmp_path):
    """The TrainingArguments passed are not changed (the Trainer's clip is off on a
    copy); what would silently break the privacy analysis is refused by name."""
    data = docstring_examples("module", seq_len=16)
    given = args(tmp_path, max_grad_norm=1.0)
    trainer = PrivateTrainer(bert(), given, train_dataset=data,
                             privacy_args=PrivacyArguments(noise_multiplier=1.0))
    assert given.max_grad_norm == 1.0 and trainer.args.max_grad_norm == 0.0
    with pytest.raises(ValueError, match="label_smoothing_factor"):
        PrivateTrainer(bert(), args(tmp_path, label_smoothing_factor=0.1), train_dataset=data,
                       privacy_args=PrivacyArguments(noise_multiplier=1.0))
    with pytest.raises(ValueError, match="compute_loss_func"):
        PrivateTrainer(bert(), given, train_dataset=data, compute_loss_func=lambda *a, **k: 0,
                       privacy_args=PrivacyArguments(noise_multiplier=1.0))
    with pytest.raises(ValueError, match="privacy_args"):
        PrivateTrainer(bert(), given, train_dataset=data)
    with pytest.raises(ValueError, match="not both"):
        PrivacyArguments(target_epsilon=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="secure_mode=True.*pass seed=None"):
        PrivacyArguments(noise_multiplier=1.0, secure_mode=True, seed=3)
    with pytest.raises(ValueError, match="larger than the training set"):
        PrivateTrainer(bert(), args(tmp_path, per_device_train_batch_size=400),
                       train_dataset=data,
                       privacy_args=PrivacyArguments(noise_multiplier=1.0)).train()


def test_secure_mode_noise(tmp_path):
    """secure_mode: the Trainer's step draws its noise from the OS, so two runs with the
    same seeds and batches end at different weights; sigma 0 they end at the same."""
    data = docstring_examples("module", seq_len=16)
    ends = []
    for sigma in (1.0, 1.0, 0.0, 0.0):
        model = bert()
        trainer = PrivateTrainer(model, args(tmp_path, max_steps=1), train_dataset=data,
                                 optimizers=sgd(model),
                                 privacy_args=PrivacyArguments(noise_multiplier=sigma,
                                                               secure_mode=True))
        trainer.train()
        assert isinstance(trainer.private_step.generator, SecureSource)
        ends.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert not torch.equal(ends[0], ends[1]) and torch.equal(ends[2], ends[3])


def test_empty_micro_batches(tmp_path):
    """An expected logical batch of 2 in 2 micro-batches: many are empty; every step is
    still taken and accounted, the update still PrivateStep's by hand."""
    data = docstring_examples("module", seq_len=16)
    privacy = PrivacyArguments(noise_multiplier=0.0, max_grad_norm=0.05, seed=SEED)
    model, collate = bert(), Recording()
    trainer = PrivateTrainer(model, args(tmp_path, per_device_train_batch_size=1,
                                         max_steps=6),
                             train_dataset=data, data_collator=collate,
                             optimizers=sgd(model), privacy_args=privacy)
    trainer.train()
    n, expected = len(data), 2
    micro = drawn(data, expected, 6)
    assert sum(not b for b in micro) >= 3  # the case is exercised
    reference = bert()
    by_hand(reference, micro, 2, expected, expected / n, default_per_sample_loss(reference),
            privacy)
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, r, rtol=1e-10, atol=1e-12, msg=name)
    assert trainer.private_step.accountant.steps == 6


WORKER = '''
import os, sys, torch
from transformers import TrainingArguments
from persample.cli.data import docstring_examples
from persample.integrations.transformers import PrivacyArguments, PrivateTrainer
sys.path.insert(0, {tests!r})
from test_hf_trainer import gpt2, sgd
torch.set_default_dtype(torch.float64)
per_device, out = int(sys.argv[1]), sys.argv[2]
model = gpt2(lora=True)
args = TrainingArguments(out + "/run", per_device_train_batch_size=per_device,
                         gradient_accumulation_steps=2, max_steps=3, use_cpu=True,
                         report_to=[], save_strategy="no", disable_tqdm=True, seed=3)
trainer = PrivateTrainer(model, args, train_dataset=docstring_examples("causal", 16, 48),
                         optimizers=sgd(model),
                         privacy_args=PrivacyArguments(noise_multiplier=0.0,
                                                       max_grad_norm=0.05, seed=3))
trainer.train()
if args.process_index == 0:
    torch.save({{k: v for k, v in model.state_dict().items() if "lora" in k}},
               out + f"/params-{{args.world_size}}.pt")
    print("steps", trainer.private_step.accountant.steps)
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
# the results are written: skip the interpreter's teardown, where torch's C++ threads
# sometimes abort a torchrun worker on this machine ("terminate called without an
# active exception", about one run in four, with or without persample's changes)
sys.stdout.flush()
os._exit(0)
'''


def _run(argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``argv`` in its own process group; on a timeout kill the whole group (torchrun's
    workers too), then fail."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_torchrun_two_processes_equal_one(tmp_path):
    """torchrun with 2 gloo processes (DDP as the Trainer sets it up), 4 examples per
    process per micro-batch, gives the LoRA update of one process with 8: the same
    Poisson sample split between the ranks, their clipped sums all-reduced once."""
    script = tmp_path / "train.py"
    script.write_text(WORKER.format(tests=str(Path(__file__).parent)))
    single = _run([sys.executable, str(script), "8", str(tmp_path)])
    assert single.returncode == 0, single.stderr[-3000:]
    two = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--standalone", str(script), "4", str(tmp_path)])
    assert two.returncode == 0, two.stderr[-3000:]
    assert "steps 3" in single.stdout and "steps 3" in two.stdout
    one, both = torch.load(tmp_path / "params-1.pt"), torch.load(tmp_path / "params-2.pt")
    assert set(one) == set(both) and one
    for name in one:
        torch.testing.assert_close(both[name], one[name], rtol=1e-9, atol=1e-12, msg=name)
    start = {k: v for k, v in gpt2(lora=True).state_dict().items() if "lora" in k}
    assert any(not torch.equal(one[k], start[k]) for k in one)  # it trained


@pytest.mark.keep_default_dtype
def test_bf16_runs_under_autocast_as_private_step_by_hand(tmp_path):
    """bf16=True: the micro-batches run under the Trainer's autocast (the classifier's
    output is bfloat16) and give PrivateStep's update under torch.autocast by hand, to
    bfloat16's rounding (2e-2 of the step's largest entry: autocast covers the forward in
    one and the forward and loss in the other)."""
    data = docstring_examples("module", seq_len=16)
    privacy = PrivacyArguments(noise_multiplier=0.0, max_grad_norm=0.05, seed=SEED)
    model, start = bert().float(), bert().float()
    seen = []
    model.classifier.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    trainer = PrivateTrainer(model, args(tmp_path, bf16=True), train_dataset=data,
                             optimizers=sgd(model), privacy_args=privacy)
    trainer.train()
    assert seen and set(seen) == {torch.bfloat16}
    reference = bert().float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        by_hand(reference, drawn(data, 16, 3), 2, 16, 16 / len(data),
                default_per_sample_loss(reference), privacy)
    updates = [((p - p0).detach(), (r - p0).detach(), name) for (name, p), (_, r), (_, p0)
               in zip(model.named_parameters(), reference.named_parameters(),
                      start.named_parameters())]
    scale = max(want.abs().max().item() for _, want, _ in updates)
    for update, want, name in updates:
        torch.testing.assert_close(update, want, rtol=0, atol=2e-2 * scale, msg=name)


def test_blt_trains_on_fixed_batches(tmp_path):
    """PrivacyArguments(mechanism='blt', buffers=2): the strategy made for the planned
    steps, fixed batches an epoch apart, the run one Gaussian mechanism of sigma."""
    from persample.dp import BLT, epsilon

    data = docstring_examples("module", seq_len=16)
    trainer = PrivateTrainer(bert(), args(tmp_path, max_steps=-1, num_train_epochs=1,
                                          learning_rate=1e-3),
                             train_dataset=data,
                             privacy_args=PrivacyArguments(noise_multiplier=1.0,
                                                           target_delta=1e-4,
                                                           mechanism="blt", buffers=2))
    out = trainer.train()
    step = trainer.private_step
    assert isinstance(step.mechanism, BLT) and step.mechanism.buffers == 2
    assert out.global_step == step.mechanism.steps == step.noise.t
    assert step.mechanism.cycle_length == min(step.mechanism.steps, int(len(data) / 16))
    assert trainer.epsilon() == pytest.approx(epsilon(1.0, 1.0, 1, 1e-4), rel=1e-9)


def test_bandmf_trains_to_a_target_epsilon(tmp_path):
    """PrivacyArguments(mechanism='bandmf', bands=2): the BERT classifier's 2 epochs of
    round(N / 16) steps with the strategy made for them, cyclic sampling, the noise
    multiplier calibrated over ceil(T / 2) steps at rate 2 q; refusals named."""
    data = docstring_examples("module", seq_len=16)
    trainer = PrivateTrainer(bert(), args(tmp_path, max_steps=-1, num_train_epochs=2,
                                          learning_rate=1e-3),
                             train_dataset=data,
                             privacy_args=PrivacyArguments(target_epsilon=3.0,
                                                           target_delta=1e-4,
                                                           mechanism="bandmf", bands=2))
    out = trainer.train()
    planned = 2 * round(len(data) / 16)
    step = trainer.private_step
    assert out.global_step == planned == step.mechanism.steps == step.noise.t
    assert step.mechanism.bands == 2 and step.accountant.steps == math.ceil(planned / 2)
    by_hand = PrivacyAccountant()
    by_hand.step(trainer.noise_multiplier, 2 * 16 / len(data), math.ceil(planned / 2))
    assert trainer.epsilon() == pytest.approx(by_hand.epsilon(1e-4))
    assert 2.9 < trainer.epsilon() <= 3.0
    for bad, match in [({"mechanism": "bandmf"}, "goes with bands=b"),
                       ({"mechanism": "blt", "bands": 2}, "goes with bands=b"),
                       ({"mechanism": "bandmf", "bands": 2, "buffers": 2},
                        "buffers= goes with mechanism='blt'"),
                       ({"mechanism": "tree"}, "mechanism must be None")]:
        with pytest.raises(ValueError, match=match):
            PrivacyArguments(noise_multiplier=1.0, **bad)
