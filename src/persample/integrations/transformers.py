"""DP-SGD inside the Hugging Face ``Trainer``: :class:`PrivateTrainer` and
:class:`PrivacyArguments`.

``PrivateTrainer`` is a ``transformers.Trainer``: the model, ``TrainingArguments``,
datasets, collators, optimizers, schedulers, callbacks, logging and evaluation are
the ``Trainer``'s own. What changes is the training step: each optimizer step is one
Poisson-sampled logical batch (Abadi et al. 2016) of expected size
``per_device_train_batch_size * gradient_accumulation_steps * world_size``, whose
share on each process is split into ``gradient_accumulation_steps`` micro-batches;
each micro-batch adds its samples' clipped gradients to a
:class:`~persample.dp.PrivateStep`, and the last one releases the noised sum into
``p.grad`` (noise drawn once per logical step, on rank 0 when distributed) before the
``Trainer`` steps its optimizer. The accountant records each release;
:meth:`PrivateTrainer.epsilon` is the privacy spent and is logged beside the loss.

The same design for the ``Trainer`` as dp-transformers (Microsoft, Opacus inside the
``Trainer``) and Opacus's virtual steps; per-sample gradients from persample's rules
(any model it runs: peft adapters, tied embeddings, several processes).
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from ..dp import (
    EmptySafeCollate,
    PrivateStep,
    noise_multiplier_for,
)
from ..dp.clipping import Clipping
from ..dp.mechanisms import Mechanism, accounted_runs, resolve_mechanism
from ..dp.sampling import logical_sampler, users_of_records
from ..dp.setup import PhysicalBatches, Seeds, shared_seeds

PRIVACY_STATE = "privacy_state.pt"
"""The file in each checkpoint folder that holds the accountant's steps (resuming needs it)."""

_ACCOUNTANTS = ("rdp", "pld", "prv")


@dataclass
class PrivacyArguments:
    """The privacy settings of a :class:`PrivateTrainer` (``privacy_args=``).

    Give ``target_epsilon`` (the noise multiplier is then the smallest that spends at
    most ``(target_epsilon, target_delta)`` over the planned optimizer steps: the
    ``TrainingArguments``' ``max_steps``, or ``num_train_epochs`` epochs of
    ``round(N / expected batch)`` steps) or ``noise_multiplier`` (then epsilon is only
    reported), not both.

    Args:
        target_epsilon: the epsilon budget of the whole run, ``> 0``.
        target_delta: ``delta`` in ``(0, 1)``, for the calibration and the logged
            epsilon (below ``1 / N`` as a rule).
        noise_multiplier: ``sigma >= 0``: the noise's std is ``sigma * max_grad_norm``.
        max_grad_norm: the clipping norm ``C > 0`` of each sample's gradient (loss units
            per parameter unit); a list of norms, one per group of ``param_groups``; or
            ``"automatic"`` (Bu et al. 2023; the kinds and their sensitivity:
            :mod:`persample.dp.clipping`). The ``TrainingArguments``' own
            ``max_grad_norm`` (a clip of the summed gradient) is not applied.
        per_layer: clip each parameter's gradient to ``C / sqrt(K)`` (``K`` parameters).
        param_groups: lists of the model's trainable parameter names, each clipped as a
            group to its own norm (a list ``max_grad_norm``).
        automatic_gamma: ``gamma > 0`` of automatic clipping.
        clipping: a :class:`persample.dp.Clipping` instead of the four fields above
            (any kind: flat, per layer, by groups, automatic, adaptive with
            ``Clipping.flat(C, adaptive=AdaptiveClipping(...))``, one process), which
            then keep their defaults.
        accountant: ``"rdp"`` (default), ``"pld"`` or ``"prv"``.
        seed: seeds the Poisson sampling (``seed``) and the noise (``seed + 1``), rank
            0's on every process (:func:`persample.dp.setup.shared_seeds`); default
            ``TrainingArguments.data_seed``, else its ``seed``.
        user_ids: user-level DP: the name of the training set's field that holds each
            record's user (``"user_id"``: a ``datasets.Dataset`` column or a key of each
            sample; never passed to the model). Users are then Poisson-sampled, ``E``
            counts users, each user's summed gradient is clipped once (on one process,
            in one micro-batch), and epsilon is per user.
        records_per_user: with ``user_ids``, at most this many of a user's records per
            step (drawn at random); default all.
        secure_mode: the noise from the operating system's cryptographically secure
            generator (``os.urandom``; threat model and cost:
            :class:`persample.dp.noise.SecureSource`); the Poisson sampling stays seeded
            (every process must draw the same sample); not with ``seed``.
        mechanism, bands, buffers: ``"bandmf"`` with ``bands=b``: correlated noise
            (:class:`persample.dp.BandMF`, made for the planned steps), the training set
            cyclically Poisson-sampled with ``b`` groups, the noise calibrated and
            accounted over ``ceil(T / b)`` steps at rate ``b q`` (Choquette-Choo et al.
            2023); ``"blt"`` with ``buffers=d`` (default 3; :class:`persample.dp.BLT`):
            fixed batches cycled each epoch, accounted as one Gaussian mechanism of the
            BLT's sensitivity (with ``user_ids``, the users so sampled); not resumed
            from a checkpoint.
        check: when a micro-batch's result is certified by identities persample does
            not compute itself (:class:`persample.dp.PrivateStep`'s ``check``):
            ``"first"``, ``"always"``, ``"never"`` or ``N``.

    Raises:
        ValueError: neither or both of ``target_epsilon`` and ``noise_multiplier``,
            ``secure_mode`` with ``seed``, or a value outside its range.

    Examples:
        >>> PrivacyArguments(target_epsilon=8.0).max_grad_norm
        1.0
        >>> PrivacyArguments()
        Traceback (most recent call last):
        ...
        ValueError: give target_epsilon (the noise is calibrated to it) or noise_multiplier, not neither

    Source: Abadi et al. 2016 (DP-SGD and its accounting).
    """  # noqa: E501

    target_epsilon: float | None = None
    target_delta: float = 1e-5
    noise_multiplier: float | None = None
    max_grad_norm: float | list[float] | str = 1.0
    per_layer: bool = False
    param_groups: list[list[str]] | None = None
    automatic_gamma: float = 0.01
    clipping: Clipping | None = None
    accountant: str = "rdp"
    seed: int | None = None
    secure_mode: bool = False
    user_ids: str | None = None
    records_per_user: int | None = None
    mechanism: str | None = None
    bands: int | None = None
    buffers: int | None = None
    check: str | int | None = None

    def chosen_clipping(self) -> Clipping:
        """The :class:`persample.dp.Clipping` these arguments give (``clipping``, else
        one of ``max_grad_norm``, ``per_layer``, ``param_groups`` and
        ``automatic_gamma``).

        Raises:
            ValueError: ``clipping`` with any of those fields changed from its default,
                or a bad clipping.
        """
        if self.clipping is not None:
            moved = [name for name, default in (("max_grad_norm", 1.0), ("per_layer", False),
                                                ("param_groups", None),
                                                ("automatic_gamma", 0.01))
                     if getattr(self, name) != default]
            if moved:
                raise ValueError(f"pass clipping= or {', '.join(moved)}, not both: the "
                                 "Clipping holds them")
            return Clipping.resolve(self.clipping)
        return Clipping(self.max_grad_norm, self.per_layer, self.param_groups,
                        self.automatic_gamma)

    def __post_init__(self) -> None:
        given = (self.target_epsilon is not None, self.noise_multiplier is not None)
        if given == (False, False) or given == (True, True):
            which = "neither" if given == (False, False) else "both"
            raise ValueError("give target_epsilon (the noise is calibrated to it) or "
                             f"noise_multiplier, not {which}")
        if self.target_epsilon is not None and not self.target_epsilon > 0:
            raise ValueError(f"target_epsilon must be > 0, got {self.target_epsilon!r}")
        if self.noise_multiplier is not None and not self.noise_multiplier >= 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {self.noise_multiplier!r}")
        if not 0 < self.target_delta < 1:
            raise ValueError(f"target_delta must be in (0, 1), got {self.target_delta!r}")
        self.chosen_clipping()  # checked here (the names: at train())
        if self.secure_mode and self.seed is not None:
            raise ValueError("secure_mode=True draws the noise from the operating system's "
                             "secure generator, which has no seed: pass seed=None")
        if self.mechanism not in (None, "bandmf", "blt"):
            raise ValueError(f"mechanism must be None (DP-SGD), 'bandmf' or 'blt', got "
                             f"{self.mechanism!r}")
        if (self.mechanism == "bandmf") != (self.bands is not None):
            raise ValueError("mechanism='bandmf' goes with bands=b (the bands of C), and "
                             "bands= with mechanism='bandmf'")
        if self.buffers is not None and self.mechanism != "blt":
            raise ValueError("buffers= goes with mechanism='blt'")
        for name in ("bands", "buffers"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.accountant not in _ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {_ACCOUNTANTS}, got "
                             f"{self.accountant!r}")


# ---------------------------------------------------------------------------
# the default per-sample loss

def default_per_sample_loss(model: nn.Module) -> Callable[[Any, Mapping[str, Tensor]], Tensor]:
    """Each sample's own loss from a ``transformers`` model's ``logits`` and the batch's
    ``labels``, as the model's loss computes it for the batch.

    - Token-level (``logits`` ``(B, T, V)``, ``labels`` ``(B, T)``): the cross-entropy
      of each token whose label is not ``-100``, averaged over the sample's tokens (0 for
      a sample without any); shifted by one position for causal language models
      (``logits[:, t]`` predicts ``labels[:, t + 1]``; a model of transformers' causal-LM
      mapping, or whose ``loss_type`` is the causal one, not encoder-decoder).
    - Sequence-level (``logits`` ``(B, C)``): by the config's ``problem_type``, or as
      transformers infers it: ``num_labels == 1`` regression (squared error), integer
      labels single-label (cross-entropy), else multi-label (binary cross-entropy with
      logits, averaged over the labels).

    Args:
        model: the model (a ``PreTrainedModel``, or a peft model around one).

    Returns:
        ``loss(outputs, inputs) -> (B,)``: ``outputs`` the model's output (``.logits``
        or ``["logits"]``), ``inputs`` the batch (``inputs["labels"]``); float32 or
        wider, in nats (or squared label units).

    Examples:
        >>> from transformers import BertConfig, BertForSequenceClassification
        >>> bert = BertForSequenceClassification(BertConfig(
        ...     vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        ...     intermediate_size=16, num_labels=3))
        >>> loss = default_per_sample_loss(bert)
        >>> batch = {"input_ids": torch.randint(0, 30, (4, 5)), "labels": torch.tensor([0, 2, 1, 0])}
        >>> loss(bert(input_ids=batch["input_ids"]), batch).shape
        torch.Size([4])

    Source: transformers' own losses (``ForCausalLMLoss``, the sequence classifiers'),
    per sample instead of over the batch.
    """  # noqa: E501
    shifts = _shifts_labels(model)
    config = getattr(_base(model), "config", None)
    problem = getattr(config, "problem_type", None)
    num_labels = getattr(config, "num_labels", None)

    def per_sample_loss(outputs: Any, inputs: Mapping[str, Tensor]) -> Tensor:
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs.logits
        labels = inputs["labels"]
        if logits.dim() >= 3 and labels.dim() == 2:  # (B, T, V) against (B, T)
            return _token_loss(logits, labels, shifts)
        return _sequence_loss(logits, labels, problem, num_labels)

    return per_sample_loss


def _token_loss(logits: Tensor, labels: Tensor, shifts: bool) -> Tensor:
    """(B,) mean cross-entropy over each sample's labelled tokens."""
    if shifts:
        logits, labels = logits[:, :-1], labels[:, 1:]
    per_token = F.cross_entropy(_wide(logits).transpose(1, 2), labels, reduction="none",
                                ignore_index=-100)  # (B, T)
    return per_token.sum(1) / (labels != -100).sum(1).clamp(min=1)


def _sequence_loss(logits: Tensor, labels: Tensor, problem: str | None,
                   num_labels: int | None) -> Tensor:
    """(B,) as transformers' sequence classifiers compute it, per sample."""
    if problem is None:
        problem = ("regression" if num_labels == 1 else "single_label_classification"
                   if not labels.is_floating_point() else "multi_label_classification")
    logits = _wide(logits)
    if problem == "regression":
        if num_labels == 1:
            return (logits.squeeze(-1) - labels.to(logits.dtype)) ** 2
        return ((logits - labels.to(logits.dtype)) ** 2).flatten(1).mean(1)
    if problem == "single_label_classification":
        return F.cross_entropy(logits.view(labels.shape[0], -1), labels.view(-1),
                               reduction="none")
    return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype),
                                              reduction="none").flatten(1).mean(1)


def _wide(logits: Tensor) -> Tensor:
    """float16/bfloat16 logits in float32 (the loss's precision); float32/64 as they are."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def _base(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (or the model)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _shifts_labels(model: nn.Module) -> bool:
    """Whether the model is a causal LM whose loss shifts its labels by one position."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    base = _base(model)
    if getattr(getattr(base, "config", None), "is_encoder_decoder", False):
        return False
    names = {n for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
             for n in ((v,) if isinstance(v, str) else v)}
    if type(base).__name__ in names:
        return True
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:
        return False
    return LOSS_MAPPING.get(getattr(base, "loss_type", None)) is ForCausalLMLoss


# ---------------------------------------------------------------------------
# the batches

USER_TAG = "persample_user_id"
"""The key each sample's user travels under from the dataset to ``training_step``."""


class _Tagged(Dataset):
    """The training set, each sample (a mapping) with its user under :data:`USER_TAG`."""

    def __init__(self, dataset: Any, users: Tensor):
        self.dataset, self.users = dataset, users

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {**self.dataset[i], USER_TAG: int(self.users[i])}


class _TaggedCollate:
    """The Trainer's collator for the samples without the tag; the tags ``(b,)`` added."""

    def __init__(self, collate: Callable[[list], Any]):
        self.collate = collate

    def __call__(self, samples: list[dict[str, Any]]) -> Any:
        users = torch.tensor([s[USER_TAG] for s in samples], dtype=torch.int64)
        batch = self.collate([{k: v for k, v in s.items() if k != USER_TAG} for s in samples])
        batch[USER_TAG] = users
        return batch


# ---------------------------------------------------------------------------

class PrivateTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` that trains with DP-SGD.

    Takes every ``Trainer`` argument, plus ``privacy_args`` (:class:`PrivacyArguments`)
    and ``per_sample_loss``. The ``TrainingArguments`` keep their meaning, except:
    an optimizer step is one Poisson-sampled logical batch (each example included with
    probability ``q = E / N``, ``E = per_device_train_batch_size *
    gradient_accumulation_steps * world_size``), an epoch ``round(N / E)`` such steps;
    each process's share of a logical batch is split into ``gradient_accumulation_steps``
    micro-batches (about ``per_device_train_batch_size`` each, empty ones included, a
    user's records in one: :func:`persample.dp.setup.physical_batches`);
    the gradient the optimizer steps with is ``(sum_i clip(g_i) + N(0, sigma^2 C^2 I)) /
    E`` (:class:`~persample.dp.PrivateStep`; ``g_i`` sample ``i``'s gradient of its own
    loss); ``max_grad_norm`` of the ``TrainingArguments`` is not applied (the per-sample
    clip is ``privacy_args.max_grad_norm``; the ``args`` object you pass is not
    changed). The logged ``loss`` is the sum of the logical batch's per-sample losses
    over ``E``; ``epsilon`` is logged with it. Checkpoints hold the accountant's steps
    (``privacy_state.pt``): resuming continues the accounting, and a checkpoint
    without them is refused. Evaluation and prediction are the ``Trainer``'s.

    With several processes (``torchrun``; DDP as the ``Trainer`` sets it up), every
    process draws the same Poisson sample (rank 0's seed) and takes its own share of it
    (:func:`persample.dp.setup.share`);
    the clipped sums of all processes and rank 0's noise are summed with one
    all-reduce (DDP's own gradient reduction does not run), and every process
    accounts each step.

    Args:
        model, args, ...: as for ``transformers.Trainer`` (the model may be a peft model:
            only its trainable parameters are trained, privately).
        privacy_args: the :class:`PrivacyArguments` (required).
        per_sample_loss: ``per_sample_loss(outputs, inputs) -> (B,)``: each sample's own
            loss from the model's output and the micro-batch (a dict with the labels);
            default :func:`default_per_sample_loss` of the model. The model is called
            without the label columns (``label_names``), so it computes no loss of its
            own.

    Raises:
        ValueError: fp16 mixed precision (its loss scaling would rescale the noised
            gradient: use ``bf16=True``), DeepSpeed, FSDP through the ``Trainer``,
            several GPUs in one process (``DataParallel``), label smoothing or a
            ``compute_loss_func`` (write them into ``per_sample_loss``), a training
            dataset without ``len()``; at ``train()``, an expected logical batch larger
            than the dataset, or a checkpoint to resume without its privacy state.

    Examples:
        >>> from transformers import BertConfig, BertForSequenceClassification, TrainingArguments
        >>> from persample.cli.data import docstring_examples
        >>> bert = BertForSequenceClassification(BertConfig(
        ...     vocab_size=257, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        ...     intermediate_size=32, num_labels=4))
        >>> args = TrainingArguments("/tmp/persample-doctest", per_device_train_batch_size=32,
        ...                          max_steps=2, use_cpu=True, report_to=[], save_strategy="no")
        >>> trainer = PrivateTrainer(bert, args, train_dataset=docstring_examples("module"),
        ...                          privacy_args=PrivacyArguments(target_epsilon=8.0))
        >>> _ = trainer.train()  # doctest: +ELLIPSIS
        {...'epsilon'...}
        >>> trainer.private_step.accountant.steps, 0 < trainer.epsilon() <= 8.0
        (2, True)

    Source: Abadi et al. 2016 (DP-SGD, Poisson lots, the moments accountant); Li et al.
    2022 (private fine-tuning of transformers); dp-transformers' ``OpacusDPTrainer``.
    """  # noqa: E501

    def __init__(self, model: nn.Module | None = None, args: Any = None, *more: Any,
                 privacy_args: PrivacyArguments | None = None,
                 per_sample_loss: Callable[[Any, Any], Tensor] | None = None,
                 **kwargs: Any) -> None:
        if not isinstance(privacy_args, PrivacyArguments):
            raise ValueError("PrivateTrainer needs privacy_args=PrivacyArguments(target_"
                             "epsilon=..., target_delta=..., max_grad_norm=...)")
        if args is not None:  # the per-sample clip replaces the Trainer's: on a copy
            args = copy.copy(args)
            args.max_grad_norm = 0.0
        super().__init__(model, args, *more, **kwargs)
        self.args.max_grad_norm = 0.0  # (the Trainer's default arguments, when none given)
        self._refuse_unsupported()
        self.privacy_args = privacy_args
        self._loss = per_sample_loss or default_per_sample_loss(self.model)
        self.private_step: PrivateStep | None = None
        self._resume_from: str | None = None
        self.add_callback(_SavePrivacyState(self))

    def _refuse_unsupported(self) -> None:
        args = self.args
        reasons = {
            "fp16=True: its loss scaling would rescale the noised gradient (use bf16=True)":
                args.fp16,
            "DeepSpeed": self.is_deepspeed_enabled,
            "FSDP through the Trainer (shard with fully_shard and use persample.dp."
            "PrivateStep)": self.is_fsdp_enabled,
            "several GPUs in one process (DataParallel): run one process per GPU with "
            "torchrun": args.n_gpu > 1,
            "label_smoothing_factor: write the smoothing into per_sample_loss":
                args.label_smoothing_factor != 0,
            "compute_loss_func: pass a per_sample_loss(outputs, inputs) -> (B,) instead":
                self.compute_loss_func is not None,
        }
        for reason, present in reasons.items():
            if present:
                raise ValueError(f"PrivateTrainer does not support {reason}")
        if self.train_dataset is not None and not hasattr(self.train_dataset, "__len__"):
            raise ValueError("PrivateTrainer's train_dataset must have len() and be "
                             "indexable: Poisson sampling picks each example by index")

    # -- the plan, the batches and the step -------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any,
              **kwargs: Any) -> Any:
        """``Trainer.train``; resuming from a checkpoint also restores the accountant's
        steps from its ``privacy_state.pt``."""
        if resume_from_checkpoint is True:
            from transformers.trainer_utils import get_last_checkpoint

            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
        self._resume_from = resume_from_checkpoint or None
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def get_train_dataloader(self) -> DataLoader:
        """Poisson-sampled logical batches, this process's share of each split into
        ``gradient_accumulation_steps`` micro-batches; builds the :class:`PrivateStep`
        (the noise multiplier for the planned steps when a target epsilon is given)."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        dataset, args, privacy = self.train_dataset, self.args, self.privacy_args
        collate = self._get_collator_with_removed_columns(self.data_collator, "training")
        n, parts = len(dataset), args.gradient_accumulation_steps
        users = (None if privacy.user_ids is None
                 else users_of_records(dataset, privacy.user_ids, n))
        units = n if users is None else len(torch.unique(users))
        expected = args.per_device_train_batch_size * parts * args.world_size
        if expected > units:
            raise ValueError(f"the expected logical batch, per_device_train_batch_size * "
                             f"gradient_accumulation_steps * world_size = {expected}, is "
                             f"larger than the training set ({units} "
                             f"{'examples' if users is None else 'users'})")
        q = expected / units
        steps_per_epoch = max(1, round(1 / q))
        seed = privacy.seed
        if seed is None:
            seed = args.data_seed if args.data_seed is not None else args.seed
        seeds = shared_seeds(seed)  # rank 0's on every process
        gen = seeds.sampling_generator()
        planned = (args.max_steps if args.max_steps > 0
                   else math.ceil(args.num_train_epochs * steps_per_epoch))
        mechanism = self._mechanism(planned, q)
        # (a mechanism: one split for the whole run, the cycle runs on)
        logical = logical_sampler(n, q, steps_per_epoch, gen, user_of=users,
                                  records_per_user=privacy.records_per_user,
                                  cycle_length=None if mechanism is None
                                  else mechanism.cycle_length)
        if users is not None:  # each record tagged with its user, the tag taken off
            dataset, collate = _Tagged(dataset, users), _TaggedCollate(collate)
        self.private_step = self._make_step(q, expected, planned, seeds, mechanism)
        micro = PhysicalBatches(logical, parts=parts, rank=args.process_index,
                                world_size=args.world_size)  # this process's share, cut
        return DataLoader(dataset, batch_sampler=micro,
                          collate_fn=EmptySafeCollate(dataset, collate),
                          num_workers=args.dataloader_num_workers,
                          pin_memory=args.dataloader_pin_memory)

    def _mechanism(self, planned: int, q: float) -> Mechanism | None:
        """The mechanism made for the ``planned`` steps (``None``: DP-SGD).

        Raises:
            ValueError: ``cycle_length * q > 1``, or a resumed run (its noise's state is
                not in the Trainer's checkpoints).
        """
        privacy = self.privacy_args
        if privacy.mechanism is None:
            return None
        if self._resume_from is not None:
            raise ValueError(f"PrivateTrainer does not resume a mechanism="
                             f"{privacy.mechanism!r} run: the noise's state and the "
                             f"sampling cycle are not in its checkpoints; train from the "
                             f"start, or use PrivateStep's state_dict in a loop of your own")
        return resolve_mechanism(privacy.mechanism, planned, q, bands=privacy.bands,
                                 buffers=privacy.buffers)

    def _make_step(self, q: float, expected: int, planned: int, seeds: Seeds,
                   mechanism: Mechanism | None = None) -> PrivateStep:
        privacy = self.privacy_args
        sigma = privacy.noise_multiplier
        if sigma is None:
            (_, rate, count), = accounted_runs(mechanism, 0.0, q, planned)
            sigma = noise_multiplier_for(privacy.target_epsilon, privacy.target_delta, rate,
                                         count, privacy.accountant)
        noise = None
        if not privacy.secure_mode:
            device = next(p for p in self.model.parameters() if p.requires_grad).device
            noise = seeds.noise_generator(device)
        # a second train() continues the accounting of the first
        accountant = privacy.accountant if self.private_step is None else \
            self.private_step.accountant
        step = PrivateStep(self.model, self._loss, clipping=privacy.chosen_clipping(),
                           noise_multiplier=sigma, expected_batch_size=expected,
                           generator=noise, sample_rate=q,
                           accountant=accountant, secure_mode=privacy.secure_mode,
                           mechanism=mechanism, check=privacy.check)
        if self._resume_from is not None:
            path = os.path.join(self._resume_from, PRIVACY_STATE)
            if not os.path.isfile(path):
                raise ValueError(f"{self._resume_from} has no {PRIVACY_STATE}: without the "
                                 "steps already taken, epsilon would restart at 0. Resume "
                                 "from a checkpoint PrivateTrainer saved")
            step.accountant.load_state_dict(torch.load(path, weights_only=False))
        return step

    # -- one micro-batch -----------------------------------------------------------------

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> Tensor:
        """Add the micro-batch's clipped per-sample gradients to the step; on the
        logical batch's last micro-batch, release the noised sum into ``p.grad``.
        Returns the micro-batch's share of the logged loss (its per-sample losses
        summed, over the expected logical batch size)."""
        model.train()
        inputs = self._prepare_inputs(inputs)
        labels = set(self.label_names or ["labels"])
        users = inputs.pop(USER_TAG, None)  # user-level DP: each sample's user
        features = {k: v for k, v in inputs.items() if k not in labels}
        with self.compute_loss_context_manager():
            losses, _ = self.private_step.accumulate(features, inputs, users)
        if self.accelerator.sync_gradients:  # the Trainer steps its optimizer next
            self.private_step.release()
        total = losses.sum()
        share = self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps
        return (total.float() / share).detach().to(self.args.device)

    # -- what it reports -----------------------------------------------------------------

    def epsilon(self, delta: float | None = None) -> float:
        """The privacy spent by the optimizer steps so far (0 before the first).

        Args:
            delta: default ``privacy_args.target_delta``.

        Returns:
            epsilon (a float), from the accountant of ``privacy_args.accountant``.
        """
        if self.private_step is None:
            return 0.0
        return self.private_step.epsilon(delta or self.privacy_args.target_delta)

    @property
    def noise_multiplier(self) -> float | None:
        """``sigma`` of the run (known once ``train()`` has planned it)."""
        return None if self.private_step is None else self.private_step.noise_multiplier

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """``Trainer.log``, with ``epsilon`` beside the training loss."""
        if "loss" in logs or "train_loss" in logs:
            logs["epsilon"] = self.epsilon()
        super().log(logs, *args, **kwargs)


class _SavePrivacyState(transformers.TrainerCallback):
    """Writes the accountant's steps into each checkpoint the Trainer saves."""

    def __init__(self, trainer: PrivateTrainer):
        self.trainer = trainer

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = self.trainer.private_step
        if step is None or not args.should_save:
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if os.path.isdir(folder):
            torch.save(step.accountant.state_dict(), os.path.join(folder, PRIVACY_STATE))
