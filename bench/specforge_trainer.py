"""SpecForge 0.2.0's EAGLE-3 training over this project's extracted data, for a side-by-side quality benchmark.

``python3 bench/specforge_trainer.py --data-dir D --output-dir O --steps N --lr X --batch-tokens B --seed S
[--ttt 7] [--epochs 1] [--eval-ratio 0.0] [--device auto|cpu|cuda] [--dtype auto|bfloat16|float32]
[--attention-backend auto|flex_attention|sdpa] [--draft-vocab-size D] [--specforge-path P]`` trains a drafter
with SpecForge's own training step on exactly the batches ``eagle3-pipeline train`` would train on with the same
data, steps, batch budget and seed, and writes what ``eagle3-pipeline evaluate`` reads:

    O/drafter/          our SGLang export (``export.export_sglang``): ``load_export`` / ``load_drafter`` accept it
    O/metrics.jsonl     one line per step: our loss and metric definitions computed on SpecForge's own logits of
                        that step (loss, loss_k, acc_k, cond_acc_k, acceptance_length, as ours logs them), and
                        SpecForge's own numbers (specforge_loss, specforge_ploss_k, specforge_acc_k, grad_norm, lr)
    O/training.json     the keys ``evaluate`` reads, as ours writes them (``eval`` / ``last``: acc_k, cond_acc_k,
                        acceptance_length; ``config.data_dir``, ``config.target_model_path``) and SpecForge's
                        settings; ``last`` is the last metrics.jsonl line, ``eval`` OUR held-out
                        evaluation (``trainer._Run.evaluate``) of the exported drafter on ours' eval split, since
                        SpecForge evaluates nothing by default

SpecForge is imported from ``--specforge-path`` (default: $EAGLE3_SPECFORGE_PATH, else /tmp/sf), installed with
``python3 -m pip download --no-deps specforge==0.2.0 -d W`` and ``pip install --no-deps --target /tmp/sf
W/specforge-0.2.0-*.whl``; its own code is never copied here. bench/training.py's ``import_specforge`` imports it.

What SpecForge 0.2.0's trainer does with offline data (read from the wheel; no scripts/train_eagle3*.py ships in
0.2.0: ``specforge train --config run.yaml`` in ``specforge/cli.py`` is the one entry point, and its defaults are
``specforge/config/schema.py``'s ``TrainingConfig`` / ``DataConfig`` / ``ModelConfig``):

- wiring: ``cli._train`` (``accelerate.utils.set_seed(training.seed)``, default seed 42) ->
  ``training/assembly.py`` ``build_training_run`` -> ``build_model_bundle`` + ``_ensure_offline_vocab_mapping`` ->
  ``launch.py`` ``build_offline_runtime`` -> ``training/trainer.py`` ``Trainer`` (FSDP backend,
  ``training/controller.py`` ``TrainerCore.train_step`` per micro-batch, ``TrainerController.fit``);
- draft config (``training/model_loading.py`` ``resolve_draft_config`` -> ``_generate_draft_config``): the
  target's ``_TARGET_ARCHITECTURE_FIELDS`` (sizes, heads, KV heads, head_dim, MLP width, RoPE, RMS eps, act,
  initializer_range, ...), ``LlamaForCausalLMEagle3``, 1 layer, untied, and ``draft_vocab_size`` 32000
  (``algorithms/eagle3/providers.py`` ``TargetDerivedDraftDefaults``), not capped at the target's vocabulary;
- draft model (``algorithms/model_providers.py`` ``build_eagle3_draft``): built in fp32 by
  ``AutoDraftModel.from_config`` (Hugging Face ``post_init``: every Linear N(0, 0.02), norms 1), cast to
  ``model.torch_dtype`` (bfloat16), the target's ``model.embed_tokens.weight`` copied in and frozen;
- draft vocabulary: ``training/vocab_mapping.py`` ``count_effective_feature_tokens`` counts ``input_ids`` at
  ``loss_mask`` positions of every TRAINING feature file (sorted paths, cut to ``data.max_length``), then
  ``data/preprocessing.py`` ``process_token_dict_to_mappings`` keeps ``Counter.most_common(D)`` (ties: first
  seen), pads with unseen ids below D when fewer were seen, sorts them: d2t offsets and t2d; skipped when D == V;
- teacher (``modeling/target/target_head.py`` ``TargetHead``): the target's lm_head alone in bf16; its
  ``load_weights`` needs a sharded checkpoint's ``*.index.json`` and the key ``model.lm_head_key`` (default
  ``lm_head.weight``: a tied target needs ``model.embed_tokens.weight``); ``preprocess`` shifts input_ids and the
  stored last hidden states left by one; the full-vocabulary logits ([B, T, V], fp32 in ``_compute_target_p``)
  unless ``training.compact_teacher`` (default off);
- per sample (``algorithms/eagle3/data.py`` ``normalize_offline_sample``): cut to ``data.max_length`` (2048),
  the last position's loss_mask set to 0; batches (``data/utils.py`` ``DataCollatorWithPadding``): right-padded
  with zeros to the longest sample, attention_mask 1/0; ``training.batch_size`` 1 (one sample a step, no
  packing), order ``launch.py`` ``_distributed_sampler_indices`` (``randperm`` seeded seed + epoch), drop_last;
- the step (``algorithms/eagle3/model.py`` ``OnlineEagle3Model.forward``, TTT ``training.ttt_length`` 7): at
  step k row t reads token x_{t+1+k} at RoPE position p_t + k (``position_ids + lck`` in both the sdpa and the
  flex_attention layers), attends the step-0 causal prefix and its own keys of steps 1..k, and is scored against
  softmax over the draft vocabulary of lm_head(l_{t+1+k}) where ``loss_mask[t+k]`` and the target's full-vocab
  top-1 at t+1+k is in the draft vocabulary; attention backend ``flex_attention`` by default;
- loss: ``core/loss.py`` ``LogSoftmaxLoss`` (a Triton kernel) = the masked soft cross-entropy summed over rows
  and divided by B*T, ALL rows (unmasked and padding ones included); ``training/strategies/base.py``
  ``Eagle3TrainStrategy.forward_loss``: sum_k 0.8^k ploss_k;
- optimizer (``optimizer.py`` ``BF16Optimizer``): bf16 model, fp32 master copies, ``torch.optim.AdamW(lr,
  weight_decay=0)`` (betas 0.9/0.999, eps 1e-8), the global grad norm of the bf16 grads clipped to
  ``training.max_grad_norm`` 0.5; ``lr_scheduler.py`` ``CosineAnnealingWarmupLR``: linear warmup over
  int(``warmup_ratio`` 0.015 x total) steps ((k + 1) / W x lr), then cosine to 0 at total, where total is
  ``training/schedule.py`` ``resolve_total_steps``: ``total_steps``, else ``max_steps``, else the epochs' steps;
  learning rate 1e-4, ``accumulation_steps`` 1. Under 67 steps W is 0 and torch's recursive cosine then starts
  ABOVE the peak: 2 / (1 + cos(pi / total)) x lr at the first step (1.17x at 4 steps, 1.03x at 10), the rest of
  the curve one step late;
- FSDP (``training/backend.py`` ``FSDPTrainingBackend.prepare_model``): SHARD_GRAD_OP, MixedPrecision(bf16
  params, fp32 buffers), even on one GPU;
- metrics (``training/controller.py`` ``_reduce_eagle3_metrics``): ploss_k, acc_k = the draft top-1 (through d2t)
  equals the target's full-vocab top-1 over the loss_mask rows (top-1s outside the draft vocabulary are misses),
  loss; logged every ``log_interval`` 50 steps; no evaluation unless ``data.eval_hidden_states_path`` and
  ``training.eval_interval`` are set (``specforge/eval`` ``Evaluator`` over a separate directory).

What this module does about it: SpecForge's own functions build the draft config (``resolve_draft_config``), the
draft (``build_eagle3_draft``, initialised under ``--seed``), the vocabulary (``process_token_dict_to_mappings``
over the training split's counts, gathered as ``count_effective_feature_tokens`` does but from our safetensors),
each sample (``normalize_offline_sample``), the step (``TrainerCore.train_step`` -> ``Eagle3TrainStrategy`` ->
``OnlineEagle3Model``), the optimizer and schedule (``BF16Optimizer``, horizon ``resolve_total_steps(max_steps=
--steps)``); the run's other settings are its defaults. What the benchmark fixes comes from ours: the batches
(``data.batches``: the same samples in the same order, each packed batch given to SpecForge as a zero-padded
batch of its samples, the tokens unchanged), the steps (ours' count: min(--steps, epochs x batches per epoch)),
the learning rate, the seed. Not SpecForge's: the embeddings and lm_head are read with our safetensors readers
(``load_target_embeddings``, ``load_lm_head``; SpecForge's readers fall back to ``torch.load`` of .bin files and
its TargetHead reads only a sharded checkpoint, and a tied one only with ``model.lm_head_key`` set to the
embedding), ``data.max_length`` is ``--batch-tokens`` (ours cuts a
longer sample to the batch; 2048 for both by default), ``draft_vocab_size`` is ours' (min(32000, V) unless
given), no FSDP wrapper (at one process SHARD_GRAD_OP over bf16 parameters computes the same step: nothing to
reduce, parameters already in the compute dtype, its fp32 buffers rounded from bf16 ones), no checkpoints (a run
is redone from the start), and metrics every step (``step_s`` and ``tokens_per_s`` time SpecForge's
``train_step`` alone).

Where ours differs (the first suspects if ours ends up below SpecForge):

1. loss normalisation: SpecForge divides each step's summed CE by B*T (every row of the padded batch), ours by
   the rows trained at that step. SpecForge's gradient therefore scales with the share of trained rows in the
   batch (batches with many trained rows weigh more), and is smaller, so its 0.5 grad clip engages less;
2. which rows train: SpecForge's mask is the anchor's (loss_mask[t+k]), ours the predicted token's
   (loss_mask[t+2+k]): SpecForge never trains to predict a turn's first two assistant tokens, and does train the
   two tokens after a turn and the prediction past a sample's last token (its teacher exists there), ours not;
3. initialisation: SpecForge N(0, 0.02) for every Linear; ours torch's default (uniform +-1/sqrt(fan_in));
4. precision: SpecForge keeps bf16 weights and activations end to end (RoPE cos/sin and the RMSNorm output
   rounded to bf16) with fp32 masters; ours fp32 weights, bf16 matmuls, fp32 norms/RoPE/softmax;
5. learning-rate schedule: SpecForge warms up over 1.5 % of its horizon and anneals to 0 at --steps (its
   max_steps); ours warms up over ``warmup_steps`` (default 0) and anneals over epochs x batches per epoch,
   ``max_steps`` only stopping the run (so a run stopped early never reaches 0);
6. draft vocabulary: SpecForge counts the training split only, ties to the first seen; ours counts the whole
   extraction (held-out samples included, ``token_counts.safetensors``), ties to the lower id;
7. batching: SpecForge's default is one sample a step; here it gets ours' packed batches as padded batches, so
   its per-step sample count varies (padding rows enter its loss denominator, see 1);
8. metrics: SpecForge's acc_k counts out-of-vocabulary top-1s as misses over the loss rows; ours is over the
   trained rows (``specforge_acc_k`` vs ``acc_k`` in metrics.jsonl);
9. step weights: SpecForge's loss weighs TTT step k by 0.8^k (its ``ploss_decay``), ours by 0.5^k by default
   (``--step-decay``; 0.8 is EAGLE-3's recipe); ours' ``loss`` of SpecForge's logits uses ours' default.
Same in both: AdamW (0.9, 0.999, 1e-8, no weight decay), grad clip 0.5, TTT 7, the soft
targets (softmax of the target's draft-vocabulary logits), positions advancing one per TTT step, the attention
pattern, the bf16 teacher on a GPU.

On the CPU (a test here): SpecForge's step does not run as shipped. ``specforge/core/loss.py`` imports
``triton`` at load (so even the import needs the triton package) and its ``LogSoftmaxLoss`` launches Triton
kernels, which need a GPU; its ``torch.compile`` decorations would compile C++ for every helper. So on the CPU
(``specforge_step_context``) ``LogSoftmaxLoss`` is replaced by SpecForge's own torch reference of the same loss
in that file (``_compute_loss``: the same sum over B*T rows) and ``torch.compile`` is disabled (the helpers run
eagerly, the same math); attention ``sdpa`` (its flex_attention cannot run without torch.compile) and float32
there. On CUDA nothing is replaced.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.metadata
import importlib.util
import json
import os
import sys
import time
import typing
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

BENCH = Path(__file__).resolve().parent
for _path in (str(BENCH.parent / "src"), str(BENCH)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from training import import_specforge  # noqa: E402  (bench/training.py)

from eagle3_pipeline.atomic import atomic_write_text  # noqa: E402
from eagle3_pipeline.evaluate.speculative import load_drafter  # noqa: E402
from eagle3_pipeline.extract.verify import load_lm_head  # noqa: E402
from eagle3_pipeline.train import export  # noqa: E402
from eagle3_pipeline.train.data import DataError, PackedBatch, Sample, TrainData, batches  # noqa: E402
from eagle3_pipeline.train.loss import teacher_targets, ttt_loss, ttt_metrics  # noqa: E402
from eagle3_pipeline.train.model import DrafterConfig  # noqa: E402
from eagle3_pipeline.train.step import StepRunner  # noqa: E402
from eagle3_pipeline.train.trainer import (  # noqa: E402
    METRICS_FILE,
    TRAINING_FILE,
    Plan,
    TrainConfig,
    TrainConfigError,
    _Run,
    load_target_embeddings,
    make_plan,
)
from eagle3_pipeline.train.vocab import VocabError, check_mapping  # noqa: E402

SPECFORGE_VERSION = "0.2.0"
SPECFORGE_PATH_ENV = "EAGLE3_SPECFORGE_PATH"
DEFAULT_SPECFORGE_PATH = "/tmp/sf"
VOCAB_FUNCTION = "process_token_dict_to_mappings"
ATTENTION_BACKENDS = ("auto", "flex_attention", "sdpa")
DTYPES = ("auto", "bfloat16", "float32")
N_AUX = 3  # SpecForge's fc is target_hidden_size * 3 wide (LlamaForCausalLMEagle3.project_hidden_states asserts it)


@dataclass(frozen=True)
class SpecForgeDefaults:
    """The settings of SpecForge 0.2.0's run config that this benchmark leaves at their defaults (schema.py)."""

    warmup_ratio: float = 0.015  # TrainingConfig.warmup_ratio
    lr_scheduler: str = "cosine"  # TrainingConfig.lr_scheduler
    max_grad_norm: float = 0.5  # TrainingConfig.max_grad_norm
    weight_decay: float = 0.0  # BF16Optimizer's default (the config has no weight decay)
    accumulation_steps: int = 1  # TrainingConfig.accumulation_steps
    attention_backend: str = "flex_attention"  # TrainingConfig.attention_backend
    torch_dtype: str = "bfloat16"  # ModelConfig.torch_dtype
    lk_loss_type: str | None = None  # TrainingConfig.lk_loss_type: the plain soft cross-entropy
    kl_scale: float = 1.0
    kl_decay: float = 1.0
    compact_teacher: bool = False  # TrainingConfig.compact_teacher
    ploss_decay: float = 0.8  # Eagle3TrainStrategy's default
    embedding_key: str = "model.embed_tokens.weight"  # ModelConfig.embedding_key


DEFAULTS = SpecForgeDefaults()


class SpecForgeUnavailable(RuntimeError):
    """SpecForge 0.2.0 cannot be imported or used here; the message says why and how to install it."""


def default_specforge_path() -> str:
    """Where SpecForge is installed: $EAGLE3_SPECFORGE_PATH, else /tmp/sf."""
    return os.environ.get(SPECFORGE_PATH_ENV) or DEFAULT_SPECFORGE_PATH


# -- SpecForge's modules ----------------------------------------------------------------------
@dataclass
class SpecForge:
    """The SpecForge 0.2.0 pieces this trainer calls, imported from ``path``."""

    path: str
    classes: dict  # bench/training.py's import_specforge: OnlineEagle3Model, TargetHead, BF16Optimizer, ...
    providers: typing.Any  # algorithms/eagle3/providers.py algorithm_providers(): draft config, build, step
    resolve_draft_config: typing.Callable
    normalize_offline_sample: typing.Callable
    resolve_total_steps: typing.Callable
    trainer_core: type
    training_backend: type
    parallel_config: type
    step_context: type
    model_module: typing.Any  # specforge.algorithms.eagle3.model (its LogSoftmaxLoss is swapped on the CPU)
    loss_module: typing.Any  # specforge.core.loss
    vocab_mapping: typing.Callable  # data/preprocessing.py process_token_dict_to_mappings
    vocab_mapping_source: str


def _vocab_mapping_function() -> tuple[typing.Callable, str]:
    """SpecForge's ``process_token_dict_to_mappings`` and where it came from.

    Its module imports ``datasets`` and a tokenizer stack at load (neither is on the GPU machine); when that
    import fails, the one function is compiled from SpecForge's installed source file alone, so the mapping
    is still built by SpecForge's own code.
    """
    name = "specforge.data.preprocessing"
    try:
        module = importlib.import_module(name)
        return getattr(module, VOCAB_FUNCTION), f"{name}.{VOCAB_FUNCTION}"
    except ImportError as exc:
        missing = exc.name
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin:
        raise SpecForgeUnavailable(f"{name} is not in the SpecForge installation; reinstall specforge "
                                   f"{SPECFORGE_VERSION}")
    source = Path(spec.origin)
    tree = ast.parse(source.read_text(encoding="utf-8"), str(source))
    node = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == VOCAB_FUNCTION), None)
    if node is None:
        raise SpecForgeUnavailable(f"{source}: no function {VOCAB_FUNCTION}; is it SpecForge {SPECFORGE_VERSION}?")
    namespace = {"Counter": Counter, "torch": torch, "Tuple": tuple}  # its annotation is Tuple[...]
    # SpecForge's own installed code, compiled without the module-level imports it does not use.
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(source), "exec"), namespace)  # noqa: PLW0122
    return namespace[VOCAB_FUNCTION], f"{source}:{VOCAB_FUNCTION} (compiled alone: {missing} is not installed)"


def load_specforge(path: str | None = None) -> SpecForge:
    """Import SpecForge 0.2.0 from ``path`` (default ``default_specforge_path()``); SpecForgeUnavailable if not."""
    path = str(path or default_specforge_path())
    how = (f"install it: python3 -m pip download --no-deps specforge=={SPECFORGE_VERSION} -d W && "
           f"pip install --no-deps --target {path} W/specforge-{SPECFORGE_VERSION}-*.whl (its loss module also "
           "needs the triton package importable)")
    classes, why = import_specforge(path)
    if classes is None:
        raise SpecForgeUnavailable(f"cannot import specforge {SPECFORGE_VERSION} from {path} ({why}); {how}")
    try:
        version = importlib.metadata.version("specforge")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version is not None and version != SPECFORGE_VERSION:
        raise SpecForgeUnavailable(f"specforge {version} is importable from {path}, this benchmark reads "
                                   f"{SPECFORGE_VERSION}'s trainer; {how}")
    try:
        from specforge.algorithms.eagle3.data import normalize_offline_sample  # noqa: PLC0415
        from specforge.algorithms.eagle3.providers import algorithm_providers  # noqa: PLC0415
        from specforge.training.backend import FSDPTrainingBackend, ParallelConfig  # noqa: PLC0415
        from specforge.training.controller import TrainerCore  # noqa: PLC0415
        from specforge.training.model_loading import resolve_draft_config  # noqa: PLC0415
        from specforge.training.schedule import resolve_total_steps  # noqa: PLC0415
        from specforge.training.strategies.base import StepContext  # noqa: PLC0415

        vocab_mapping, vocab_source = _vocab_mapping_function()
        return SpecForge(path=path, classes=classes, providers=algorithm_providers(),
                         resolve_draft_config=resolve_draft_config, normalize_offline_sample=normalize_offline_sample,
                         resolve_total_steps=resolve_total_steps, trainer_core=TrainerCore,
                         training_backend=FSDPTrainingBackend, parallel_config=ParallelConfig,
                         step_context=StepContext,
                         model_module=importlib.import_module("specforge.algorithms.eagle3.model"),
                         loss_module=importlib.import_module("specforge.core.loss"),
                         vocab_mapping=vocab_mapping, vocab_mapping_source=vocab_source)
    except ImportError as exc:
        raise SpecForgeUnavailable(f"specforge from {path} lacks a module this trainer uses ({exc}); {how}") from None


def run_config(target_model_path: str | Path, attention_backend: str, torch_dtype: str) -> SimpleNamespace:
    """The fields of ``specforge.config.Config`` that SpecForge's ``resolve_draft_config``, ``build_eagle3_draft``
    and EAGLE-3 step options read, at its defaults (its pydantic schema is not needed; pydantic is not on the GPU
    machine). The target embedding is copied by ``build_models`` with our safetensors reader instead."""
    model = SimpleNamespace(target_model_path=str(target_model_path), draft_model_config=None,
                            draft_checkpoint_path=None, cache_dir=None, trust_remote_code=False,
                            draft_num_hidden_layers=None, draft_block_size=None, vocab_mapping_path="",
                            load_target_embedding=False, embedding_key=DEFAULTS.embedding_key,
                            torch_dtype=torch_dtype)
    training = SimpleNamespace(strategy="eagle3", attention_backend=attention_backend,
                               compact_teacher=DEFAULTS.compact_teacher, compact_teacher_chunk_size=None)
    return SimpleNamespace(model=model, training=training)


class _ReferenceLoss:
    """``LogSoftmaxLoss.apply``'s signature over SpecForge's torch reference of the same loss (``_compute_loss``)."""

    def __init__(self, loss):
        self.loss = loss

    def apply(self, logits, target_p, position_mask):
        return self.loss(logits, target_p, position_mask)


@contextmanager
def specforge_step_context(sf: SpecForge, device: torch.device) -> Iterator[None]:
    """Where SpecForge's step runs: on CUDA as shipped; on the CPU with its Triton loss replaced by its torch
    reference of the same loss and ``torch.compile`` off (see the module docstring)."""
    if device.type == "cuda":
        yield
        return
    original = sf.model_module.LogSoftmaxLoss
    sf.model_module.LogSoftmaxLoss = _ReferenceLoss(sf.loss_module._compute_loss)
    try:
        with torch._dynamo.config.patch(disable=True):
            yield
    finally:
        sf.model_module.LogSoftmaxLoss = original


# -- vocabulary -------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpecForgeVocab:
    """SpecForge's draft vocabulary of a training split."""

    d2t: torch.Tensor  # [D] int64 offsets
    t2d: torch.Tensor  # [V] bool
    coverage: float  # share of the counted loss tokens in the vocabulary
    counted_tokens: int
    source: str  # which SpecForge function built it (or why none was needed)


def loss_token_counts(data: TrainData, samples: list[Sample], max_length: int, vocab_size: int) -> Counter:
    """``count_effective_feature_tokens`` over our samples: ``input_ids`` at ``loss_mask`` positions, each file cut
    to ``max_length``, the files in sorted path order, so that the Counter's insertion order (its tie-break) is
    SpecForge's. Only ``input_ids`` and ``loss_mask`` are read (safetensors)."""
    counts: Counter = Counter()
    for path in sorted(str(data.root / sample.file) for sample in samples):
        try:
            with safe_open(path, framework="pt") as handle:
                ids = handle.get_tensor("input_ids").long()[:max_length]
                mask = handle.get_tensor("loss_mask")[:max_length]
        except (SafetensorError, OSError) as exc:
            raise DataError(f"{path}: unreadable ({exc}); run `eagle3-pipeline verify`") from None
        selected = ids[mask.bool()]
        if selected.numel() and (int(selected.min()) < 0 or int(selected.max()) >= vocab_size):
            raise DataError(f"{path}: token ids outside the target vocabulary [0, {vocab_size})")
        token_ids, frequencies = selected.unique(return_counts=True)
        for token_id, frequency in zip(token_ids.tolist(), frequencies.tolist()):
            counts[int(token_id)] += int(frequency)
    return counts


def specforge_vocab(sf: SpecForge, data: TrainData, samples: list[Sample], draft_vocab_size: int,
                    vocab_size: int, max_length: int) -> SpecForgeVocab:
    """The draft vocabulary SpecForge's trainer builds from these training samples (``_ensure_offline_vocab_mapping``):
    the identity when D == V, else ``process_token_dict_to_mappings`` of their loss-token counts."""
    counts = loss_token_counts(data, samples, max_length, vocab_size)
    total = sum(counts.values())
    if draft_vocab_size == vocab_size:
        d2t = torch.zeros(vocab_size, dtype=torch.int64)
        t2d = torch.ones(vocab_size, dtype=torch.bool)
        return SpecForgeVocab(d2t, t2d, 1.0, total, "identity (SpecForge installs no mapping when D == V)")
    d2t, t2d = sf.vocab_mapping(Counter(counts), draft_vocab_size, vocab_size)  # it adds zero counts to its copy
    d2t, t2d = d2t.to(torch.int64), t2d.to(torch.bool)
    try:
        check_mapping(d2t, t2d, vocab_size)
    except VocabError as exc:
        raise VocabError(f"SpecForge's {VOCAB_FUNCTION} gave an unusable mapping ({exc})") from None
    chosen = (d2t + torch.arange(d2t.numel())).tolist()
    coverage = sum(counts.get(token, 0) for token in chosen) / total if total else 0.0
    return SpecForgeVocab(d2t, t2d, coverage, total, sf.vocab_mapping_source)


# -- models -----------------------------------------------------------------------------------
@dataclass
class SpecForgeModels:
    """SpecForge's draft, its training wrapper and teacher head, and the same drafter's shape in our terms."""

    draft_config: typing.Any  # transformers LlamaConfig, from resolve_draft_config
    draft: nn.Module  # LlamaForCausalLMEagle3
    model: nn.Module  # OnlineEagle3Model around it
    target_head: nn.Module  # TargetHead
    drafter_config: DrafterConfig  # ours, for the export
    step_options: dict  # Eagle3TrainStrategy's options from the run config (compact teacher off)

    def strategy(self, sf: SpecForge, model: nn.Module | None = None):
        """SpecForge's EAGLE-3 step strategy (``Eagle3TrainStrategy``) over ``model`` (default: ``self.model``)."""
        return sf.providers.step.build(self.model if model is None else model, target_head=self.target_head,
                                       **self.step_options)


def drafter_config_of(draft_config, draft_vocab_size: int) -> DrafterConfig:
    """Our ``DrafterConfig`` of SpecForge's draft config (a Llama config: the same keys as a target's)."""
    config = draft_config.to_dict()
    target_hidden = int(getattr(draft_config, "target_hidden_size", None) or config["hidden_size"])
    if target_hidden != int(config["hidden_size"]):
        raise TrainConfigError(f"SpecForge's draft has target_hidden_size {target_hidden} != hidden_size "
                               f"{config['hidden_size']}; this benchmark trains drafters as wide as their target")
    return DrafterConfig.from_target(config, N_AUX, draft_vocab_size)


def build_models(sf: SpecForge, target_model_path: str | Path, *, draft_vocab_size: int, d2t: torch.Tensor,
                 t2d: torch.Tensor, ttt_length: int, attention_backend: str, device: torch.device,
                 dtype: torch.dtype, seed: int, fc_norm: bool = False) -> SpecForgeModels:
    """SpecForge's draft (``resolve_draft_config``, ``build_eagle3_draft`` under ``seed``), the vocabulary installed
    as ``_install_dataset_vocab_mapping`` does, ``OnlineEagle3Model`` and ``TargetHead`` at its defaults.

    The embedding and lm_head are the target's, read with our safetensors readers (tied targets: the embedding).
    """
    dtype_name = str(dtype).removeprefix("torch.")
    cfg = run_config(target_model_path, attention_backend, dtype_name)
    draft_config = sf.resolve_draft_config(cfg, provider=sf.providers.model.draft_config)
    draft_config.draft_vocab_size = draft_vocab_size  # its default 32000 is not capped at the target's vocabulary
    draft_config.fc_norm = bool(fc_norm)  # read by its LlamaForCausalLMEagle3 (EAGLE 3.1's per-aux norms)
    drafter_config = replace(drafter_config_of(draft_config, draft_vocab_size), fc_norm=bool(fc_norm))
    torch.manual_seed(seed)
    draft = sf.providers.model.build_draft(cfg, draft_config)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(load_target_embeddings(target_model_path))
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
    draft.vocab_mapping_loaded = True
    draft = draft.to(device)
    model = sf.classes["OnlineEagle3Model"](draft, length=ttt_length, attention_backend=attention_backend,
                                            lk_loss_type=DEFAULTS.lk_loss_type, kl_scale=DEFAULTS.kl_scale,
                                            kl_decay=DEFAULTS.kl_decay).to(device=device, dtype=dtype)
    target_head = sf.classes["TargetHead"](str(target_model_path))
    with torch.no_grad():
        target_head.fc.weight.copy_(load_lm_head(target_model_path, "cpu"))
    target_head.freeze_weights()
    target_head = target_head.eval().to(device=device, dtype=dtype)
    return SpecForgeModels(draft_config, draft, model, target_head, drafter_config, sf.providers.step.options(cfg))


def export_drafter(models: SpecForgeModels, manifest: dict, out_dir: Path, dtype: torch.dtype,
                   target_model_type: str | None) -> Path:
    """SpecForge's trained draft as our SGLang export: its state dict already has our names (``midlayer.*``,
    ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``); the frozen target embedding is left out as ours leaves it."""
    state = {name: tensor.detach().cpu() for name, tensor in models.draft.state_dict().items()
             if name != "embed_tokens.weight"}
    config = {**asdict(models.drafter_config), "dtype": str(dtype).removeprefix("torch.")}
    return export.export_sglang(state, config, manifest, out_dir, target_model_type_override=target_model_type)


# -- batches ----------------------------------------------------------------------------------
@dataclass
class SpecForgeBatch:
    """One packed batch of ours as SpecForge's padded batch, and where each packed token sits in it."""

    batch: typing.Any  # specforge.runtime.contracts.TrainBatch
    lengths: list[int]  # tokens of each sample (a row of the padded batch)
    rows: tuple[torch.Tensor, torch.Tensor]  # (batch row, position) of every packed token, in packed order

    @property
    def padded_tokens(self) -> int:
        return len(self.lengths) * max(self.lengths)


def pad_features(features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``DataCollatorWithPadding``'s batch of normalized samples ([1, L, ...] each): right-padded with zeros to the
    longest, stacked on the batch dimension (its module imports ``datasets``, so its rule is applied here)."""
    longest = max(feature["input_ids"].shape[1] for feature in features)
    out = {}
    for name in ("input_ids", "attention_mask", "loss_mask", "hidden_state", "target"):
        first = features[0][name]
        padded = first.new_zeros((len(features), longest, *first.shape[2:]))
        for row, feature in enumerate(features):
            value = feature[name]
            padded[row, : value.shape[1]] = value[0]
        out[name] = padded
    return out


def to_specforge_batch(sf: SpecForge, packed: PackedBatch, max_length: int, dtype: torch.dtype,
                       ttt_length: int) -> SpecForgeBatch:
    """Split ``packed`` at its samples, normalize each with SpecForge's ``normalize_offline_sample`` (its stored
    names: ``hidden_state`` = the last hidden states, ``aux_hidden_state`` = the aux ones; the states in the
    model's dtype, as SpecForge's stored features are in its), pad them into one ``TrainBatch``."""
    _, counts = torch.unique_consecutive(packed.doc_ids, return_counts=True)
    features, start = [], 0
    for length in counts.tolist():
        stop = start + length
        raw = {"input_ids": packed.input_ids[start:stop], "loss_mask": packed.loss_mask[start:stop].long(),
               "hidden_state": packed.last_hidden[start:stop].to(dtype),
               "aux_hidden_state": packed.aux_hidden[start:stop].to(dtype)}
        features.append(sf.normalize_offline_sample(raw, max_length))
        start = stop
    lengths = [int(feature["input_ids"].shape[1]) for feature in features]
    if sum(lengths) != packed.num_tokens:
        raise DataError(f"samples {packed.sample_ids} are longer than data.max_length {max_length}: SpecForge would "
                        "see fewer tokens than ours; use --batch-tokens of at least the longest sample")
    sizes = torch.tensor(lengths)
    rows = (torch.repeat_interleave(torch.arange(len(lengths)), sizes),
            torch.cat([torch.arange(length) for length in lengths]))
    batch = sf.classes["TrainBatch"](sample_ids=list(packed.sample_ids), strategy="eagle3",
                                     tensors=pad_features(features),
                                     metadata={"target_repr": "hidden_state", "ttt_length": ttt_length})
    return SpecForgeBatch(batch, lengths, rows)


class StepLogits:
    """A forward hook on the draft's ``lm_head``: every TTT step's logits, gathered into our packed layout
    [1, N, D] at once (a copy: SpecForge's Triton backward overwrites its saved logits with their gradient)."""

    def __init__(self, lm_head: nn.Module, rows: tuple[torch.Tensor, torch.Tensor]):
        device = lm_head.weight.device
        self.rows = (rows[0].to(device), rows[1].to(device))
        self.steps: list[torch.Tensor] = []
        self.handle = lm_head.register_forward_hook(self._hook)

    def _hook(self, _module, _inputs, output):
        self.steps.append(output.detach()[self.rows][None])

    def close(self) -> None:
        self.handle.remove()


def specforge_logits(sf: SpecForge, models: SpecForgeModels, sf_batch: SpecForgeBatch,
                     device: torch.device) -> list[torch.Tensor]:
    """SpecForge's draft logits of every TTT step ([1, N, D], packed layout) for one batch, no update."""
    strategy = models.strategy(sf)
    capture = StepLogits(models.draft.lm_head, sf_batch.rows)
    try:
        with specforge_step_context(sf, device), torch.no_grad():
            strategy.forward_loss(sf_batch.batch)
    finally:
        capture.close()
    return capture.steps


# -- the run ----------------------------------------------------------------------------------
@dataclass
class SpecForgeRun:
    """What ``train`` does; the fields the benchmark fixes are ours' names (``TrainConfig``)."""

    data_dir: str
    output_dir: str
    steps: int
    lr: float
    batch_tokens: int
    seed: int
    ttt_length: int = 7
    epochs: int = 1
    eval_ratio: float = 0.0
    draft_vocab_size: int | None = None  # None: ours' default, min(32000, V)
    device: str = "auto"
    dtype: str = "auto"  # auto: bfloat16 on a GPU (SpecForge's torch_dtype), float32 on the CPU
    attention_backend: str = "auto"  # auto: flex_attention (SpecForge's default) on a GPU, sdpa on the CPU
    specforge_path: str | None = None
    log_every: int = 10
    # SpecForge's EAGLE 3.1 configuration: its draft config's ``fc_norm`` (an RMSNorm on each aux state before
    # fc). Its model has no ``norm_output`` in SGLang's sense (its ``norm_output`` is the logits' norm, on by
    # default; the next step always reads the pre-norm state): exported as SGLang's ``fc_norm`` alone.
    fc_norm: bool = False

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise TrainConfigError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got "
                                   f"{self.attention_backend!r}")
        if self.dtype not in DTYPES:
            raise TrainConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if isinstance(self.log_every, bool) or not isinstance(self.log_every, int) or self.log_every < 1:
            raise TrainConfigError(f"log_every must be an integer >= 1, got {self.log_every!r}")

    def our_config(self) -> TrainConfig:
        """Ours' settings for the same data, split, batches and steps (validated by ``TrainConfig``)."""
        return TrainConfig(data_dir=self.data_dir, output_dir=self.output_dir, draft_vocab_size=self.draft_vocab_size,
                           ttt_length=self.ttt_length, epochs=self.epochs, max_steps=self.steps, lr=self.lr,
                           batch_tokens=self.batch_tokens, eval_ratio=self.eval_ratio, seed=self.seed,
                           device=self.device, dtype="auto" if self.dtype == "auto" else self.dtype,
                           tensorboard=False, charts=False)


def _say(message: str) -> None:
    print(f"specforge train: {message}", flush=True)


def _resolve(run: SpecForgeRun, plan: Plan) -> tuple[torch.dtype, str]:
    dtype = torch.bfloat16 if plan.dtype == "bfloat16" else torch.float32
    backend = run.attention_backend
    if backend == "auto":
        backend = DEFAULTS.attention_backend if plan.device.type == "cuda" else "sdpa"
    return dtype, backend


def _our_metrics(steps: list[torch.Tensor], packed: PackedBatch, lm_head: torch.Tensor, draft: nn.Module,
                 ttt_length: int) -> dict:
    """Ours' loss and metric definitions (``ttt_loss``, ``ttt_metrics``) of SpecForge's logits of one batch."""
    if len(steps) != ttt_length:
        raise RuntimeError(f"captured {len(steps)} draft lm_head calls in a step of TTT length {ttt_length}: "
                           "SpecForge's forward is not the one this benchmark reads")
    device = lm_head.device
    teacher = teacher_targets(packed.last_hidden.to(device)[None], lm_head, draft.t2d, draft.d2t,
                              packed.loss_mask.to(device)[None], packed.doc_ids.to(device)[None])
    loss = ttt_loss(steps, teacher)
    metrics = ttt_metrics(steps, teacher)
    return {"loss": float(loss.loss), "loss_k": [float(x) for x in loss.step_losses], "acc_k": metrics.acc,
            "cond_acc_k": metrics.cond_acc, "acceptance_length": metrics.acceptance_length}


def _specforge_metrics(metrics: dict, ttt_length: int) -> dict:
    """SpecForge's own step numbers (``TrainerCore._result``), per position as lists."""
    def per_position(prefix: str) -> list[float]:
        return [float(metrics[f"{prefix}_{k}"]) for k in range(ttt_length) if f"{prefix}_{k}" in metrics]

    return {"specforge_loss": float(metrics["loss"]), "specforge_ploss_k": per_position("ploss"),
            "specforge_acc_k": per_position("acc"), "specforge_acceptance_rate_k": per_position("acceptance_rate"),
            "grad_norm": float(metrics["grad_norm"]) if metrics.get("grad_norm") is not None else None}


def train(run: SpecForgeRun) -> dict:
    """Train with SpecForge's step on ours' batches, export to ``<out>/drafter``, evaluate; the summary dict
    (also written to ``<out>/training.json``). A run starts over: no checkpoints are kept."""
    started = time.monotonic()
    sf = load_specforge(run.specforge_path)
    cfg = run.our_config()
    plan = make_plan(cfg)
    dtype, backend = _resolve(run, plan)
    device = plan.device
    if device.type != "cuda" and backend == "flex_attention":
        raise TrainConfigError("attention_backend flex_attention needs torch.compile, which the CPU path turns off "
                               "(specforge_step_context); use sdpa (or auto) on the CPU")
    out_dir = Path(run.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in (METRICS_FILE, TRAINING_FILE):  # a fresh run: nothing of an earlier one may be read as this one's
        (out_dir / name).unlink(missing_ok=True)
    vocab_size = int(plan.target_config["vocab_size"])
    draft_vocab_size = plan.drafter_config.draft_vocab_size
    max_length = run.batch_tokens
    vocab = specforge_vocab(sf, plan.data, plan.train_samples, draft_vocab_size, vocab_size, max_length)
    _say(f"draft vocabulary {draft_vocab_size} of {vocab_size} ({vocab.source}), coverage {vocab.coverage:.4f} of "
         f"{vocab.counted_tokens} training loss tokens")
    models = build_models(sf, plan.target_path, draft_vocab_size=draft_vocab_size, d2t=vocab.d2t, t2d=vocab.t2d,
                          ttt_length=run.ttt_length, attention_backend=backend, device=device, dtype=dtype,
                          seed=run.seed, fc_norm=run.fc_norm)
    if models.drafter_config != replace(plan.drafter_config, fc_norm=run.fc_norm):
        _say(f"note: SpecForge's draft shape {models.drafter_config} differs from ours {plan.drafter_config}")
    horizon = sf.resolve_total_steps(total_steps=None, max_steps=run.steps, num_samples=len(plan.train_samples),
                                     batch_size=1, accumulation_steps=DEFAULTS.accumulation_steps,
                                     num_epochs=run.epochs)

    def optimizer_factory(module: nn.Module):
        return sf.classes["BF16Optimizer"](module, lr=run.lr, weight_decay=DEFAULTS.weight_decay,
                                           max_grad_norm=DEFAULTS.max_grad_norm, total_steps=horizon,
                                           warmup_ratio=DEFAULTS.warmup_ratio, lr_scheduler=DEFAULTS.lr_scheduler)

    backend_obj = sf.training_backend(sf.parallel_config(), optimizer_factory=optimizer_factory)
    wrapped = backend_obj.prepare_model(models.model, wrap=False, optimizer_target=models.model.draft_model)
    strategy = models.strategy(sf, wrapped)
    core = sf.trainer_core(strategy, backend_obj, accumulation_steps=DEFAULTS.accumulation_steps)
    lm_head = load_lm_head(plan.target_path, "cpu" if device.type == "cpu" else str(device))
    _say(f"{plan.limit} steps of ours' batches ({len(plan.train_samples)} training samples, {len(plan.held)} "
         f"held out), {backend} attention, {str(dtype).removeprefix('torch.')} on {device}; LR {run.lr} warmup "
         f"{int(DEFAULTS.warmup_ratio * horizon)} steps, cosine to 0 at step {horizon}")

    metrics_log = open(out_dir / METRICS_FILE, "a")  # noqa: SIM115 - closed below
    step, epoch, last, tokens_seen = 0, 0, None, 0
    train_started = time.monotonic()
    try:
        wrapped.train()
        with specforge_step_context(sf, device):
            stream = batches(plan.data, run.batch_tokens, run.seed, 0, 1, samples=plan.train_samples,
                             epochs=run.epochs)
            for after, packed in stream:
                sf_batch = to_specforge_batch(sf, packed, max_length, dtype, run.ttt_length)
                lr = float(backend_obj.optimizer.get_learning_rate())  # this step's (the scheduler steps after it)
                capture = StepLogits(models.draft.lm_head, sf_batch.rows)
                step_started = time.perf_counter()
                try:
                    # its metrics' .item() calls end the step on the device before the clock is read
                    result = core.train_step(sf_batch.batch, ctx=sf.step_context(global_step=step,
                                                                                 total_steps=horizon))
                finally:
                    capture.close()
                elapsed = max(time.perf_counter() - step_started, 1e-9)
                step += 1
                with torch.no_grad():
                    ours = _our_metrics(capture.steps, packed, lm_head, models.draft, run.ttt_length)
                tokens_seen += packed.num_tokens
                last = {"kind": "train", "step": step, "epoch": epoch + 1, **ours,
                        **_specforge_metrics(result.metrics, run.ttt_length), "lr": lr, "tokens": packed.num_tokens,
                        "padded_tokens": sf_batch.padded_tokens, "samples": len(sf_batch.lengths),
                        "step_s": elapsed, "tokens_per_s": packed.num_tokens / elapsed}
                metrics_log.write(json.dumps(last) + "\n")
                metrics_log.flush()
                epoch = after.epoch
                if step % run.log_every == 0 or step >= plan.limit:
                    _say(f"step {step}/{plan.limit} loss {last['loss']:.4f} (SpecForge's {last['specforge_loss']:.4f}) "
                         f"acc_0 {last['acc_k'][0]:.3f} accept {last['acceptance_length']:.3f} "
                         f"{last['tokens_per_s']:.0f} tokens/s")
                if step >= plan.limit:
                    break
    finally:
        metrics_log.close()
    train_s = time.monotonic() - train_started

    drafter_dir = export_drafter(models, plan.data.manifest, plan.drafter_dir, dtype,
                                 plan.target_config.get("model_type"))
    evaluation = None
    if plan.held:
        drafter, _ = load_drafter(drafter_dir, load_target_embeddings(plan.target_path), device)
        runner = StepRunner(drafter, lm_head, ttt_length=run.ttt_length, device=device, dtype=plan.dtype,
                            parallel="ddp")
        evaluation = _Run(cfg, plan.data, runner, 0, 1).evaluate(plan.held)
        _say(f"held-out ({len(plan.held)} samples, ours' evaluation): acc_k "
             f"{[round(a, 3) for a in evaluation['acc_k']]}, acceptance length {evaluation['acceptance_length']:.3f}")
    summary = {
        "trainer": f"specforge {SPECFORGE_VERSION}", "steps": step, "total_steps": horizon, "limit_steps": plan.limit,
        "last": last, "eval": evaluation, "drafter_dir": str(drafter_dir), "draft_vocab_size": draft_vocab_size,
        "draft_vocab_coverage": vocab.coverage, "draft_vocab_source": vocab.source, "world": 1,
        "device": str(device), "dtype": plan.dtype, "tokens": tokens_seen, "train_s": train_s,
        "wall_s": time.monotonic() - started,
        "config": {**asdict(cfg), "data_dir": str(Path(run.data_dir).resolve()),
                   "target_model_path": str(Path(plan.target_path).resolve()), "max_steps": run.steps},
        "specforge": {"path": sf.path, "version": SPECFORGE_VERSION, "attention_backend": backend,
                      "max_length": max_length, "schedule_total_steps": horizon,
                      "warmup_steps": int(DEFAULTS.warmup_ratio * horizon), **asdict(DEFAULTS),
                      "draft_config": models.draft_config.to_dict(), "fc_norm": run.fc_norm},
    }  # fmt: skip
    atomic_write_text(out_dir / TRAINING_FILE, json.dumps(summary, indent=1, default=str) + "\n")
    _say(f"{step} steps in {train_s:.1f} s; drafter exported to {drafter_dir}; {out_dir / TRAINING_FILE}")
    return summary


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); 0 when trained, 2 when the input or SpecForge is unusable."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", required=True, help="the extraction output (data_config.json + rows_*/)")
    parser.add_argument("--output-dir", required=True, help="where drafter/, metrics.jsonl, training.json go")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps (SpecForge's max_steps)")
    parser.add_argument("--lr", type=float, required=True, help="peak learning rate")
    parser.add_argument("--batch-tokens", type=int, required=True, help="ours' packed batch budget (tokens)")
    parser.add_argument("--seed", type=int, required=True, help="data order and draft initialisation")
    parser.add_argument("--ttt", type=int, default=7, help="TTT length (SpecForge's ttt_length)")
    parser.add_argument("--epochs", type=int, default=1, help="passes over the training split (ours' epochs)")
    parser.add_argument("--eval-ratio", type=float, default=0.0, help="held-out share, split as ours splits it")
    parser.add_argument("--draft-vocab-size", type=int, default=None, help="default: min(32000, V), as ours")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", choices=DTYPES)
    parser.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    parser.add_argument("--specforge-path", default=None,
                        help=f"where specforge {SPECFORGE_VERSION} is installed (default ${SPECFORGE_PATH_ENV} or "
                             f"{DEFAULT_SPECFORGE_PATH})")
    parser.add_argument("--log-every", type=int, default=10, help="print a progress line every N steps")
    parser.add_argument("--fc-norm", action="store_true",
                        help="SpecForge's EAGLE 3.1 configuration (its draft config's fc_norm)")
    args = parser.parse_args(argv)
    try:
        run = SpecForgeRun(data_dir=args.data_dir, output_dir=args.output_dir, steps=args.steps, lr=args.lr,
                           batch_tokens=args.batch_tokens, seed=args.seed, ttt_length=args.ttt, epochs=args.epochs,
                           eval_ratio=args.eval_ratio, draft_vocab_size=args.draft_vocab_size, device=args.device,
                           dtype=args.dtype, attention_backend=args.attention_backend,
                           specforge_path=args.specforge_path, log_every=args.log_every, fc_norm=args.fc_norm)
        train(run)
    except (SpecForgeUnavailable, TrainConfigError, DataError, VocabError, export.ExportError) as exc:
        print(f"specforge train: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
