"""bench/specforge_trainer.py: SpecForge 0.2.0's training step over our extraction, converted to our drafter export.

Needs SpecForge 0.2.0 importable from $EAGLE3_SPECFORGE_PATH or /tmp/sf (with the triton package, which its loss
module imports); nothing is installed here: without it every test skips and says why. The data is the training
tests' tiny random Llama and its real hidden states (``train_fixtures``); on the CPU the step runs in float32 with
the sdpa attention (``specforge_step_context``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from train_fixtures import VOCAB, build_data, build_target

from eagle3_pipeline.evaluate.speculative import load_drafter
from eagle3_pipeline.train import trainer as tr
from eagle3_pipeline.train.data import batches, load_batch, open_dataset
from eagle3_pipeline.train.export import load_export
from eagle3_pipeline.train.loss import acceptance_length
from eagle3_pipeline.train.vocab import check_mapping

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import specforge_trainer as st  # noqa: E402

DRAFT_VOCAB = 48  # below VOCAB: a real d2t/t2d mapping
TTT = 3


def _specforge():
    try:
        return st.load_specforge(), None
    except st.SpecForgeUnavailable as exc:
        return None, str(exc)


SF, WHY = _specforge()
pytestmark = pytest.mark.skipif(SF is None, reason=f"SpecForge {st.SPECFORGE_VERSION} is not importable: {WHY}")


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, target):
    return build_data(tmp_path_factory.mktemp("extracted"), *target)


def first_batches(data_dir, count, batch_tokens=64, seed=0):
    data = open_dataset(data_dir)
    stream = batches(data, batch_tokens, seed, 0, 1, epochs=1)
    return data, [packed for _, packed in (next(stream) for _ in range(count))]


def test_a_packed_batch_becomes_specforge_padded_batch_with_the_same_tokens(data_dir):
    data, (packed,) = first_batches(data_dir, 1)
    assert len(packed.sample_ids) >= 2, "the fixture packs several samples into 64 tokens"
    converted = st.to_specforge_batch(SF, packed, 64, torch.float32, TTT)
    tensors = converted.batch.tensors
    lengths = [s.tokens for s in data.samples if s.id in packed.sample_ids]
    assert converted.lengths == [next(s.tokens for s in data.samples if s.id == i) for i in packed.sample_ids]
    assert sorted(converted.lengths) == sorted(lengths)
    assert tensors["input_ids"].shape == (len(lengths), max(lengths))
    assert int(tensors["attention_mask"].sum()) == packed.num_tokens
    start = 0
    for row, (sample_id, length) in enumerate(zip(packed.sample_ids, converted.lengths)):
        stop = start + length
        sample = next(s for s in data.samples if s.id == sample_id)
        stored = load_batch(data, [sample.index])
        assert torch.equal(tensors["input_ids"][row, :length], stored.input_ids)
        assert torch.equal(tensors["hidden_state"][row, :length], stored.aux_hidden.float())
        assert torch.equal(tensors["target"][row, :length], stored.last_hidden.float())
        mask = stored.loss_mask.long()
        mask[-1] = 0  # SpecForge's normalize_offline_sample: the last position never trains
        assert torch.equal(tensors["loss_mask"][row, :length], mask)
        for name in ("input_ids", "attention_mask", "loss_mask", "hidden_state", "target"):
            assert not tensors[name][row, length:].any(), f"{name} is padded with zeros"
        # the mapping back to the packed layout
        assert torch.equal(converted.rows[0][start:stop], torch.full((length,), row))
        assert torch.equal(converted.rows[1][start:stop], torch.arange(length))
        start = stop


def test_draft_vocabulary_is_specforge_rule_over_the_training_split(data_dir):
    data = open_dataset(data_dir)
    train, held = data.split(0.2)
    assert held, "the split must hold something out for this test to mean anything"
    vocab = st.specforge_vocab(SF, data, train, DRAFT_VOCAB, VOCAB, 64)
    check_mapping(vocab.d2t, vocab.t2d, VOCAB)
    # the loss tokens of the TRAINING files, in SpecForge's insertion order (sorted paths, ids ascending per file)
    counts = Counter()
    for sample in sorted(train, key=lambda s: str(data.root / s.file)):
        stored = load_batch(data, [sample.index])
        selected = stored.input_ids[stored.loss_mask]
        for token in sorted(set(selected.tolist())):
            counts[token] += int((selected == token).sum())
    assert len(counts) > DRAFT_VOCAB, "more tokens seen than the draft vocabulary holds: a real choice"
    chosen = set((vocab.d2t + torch.arange(DRAFT_VOCAB)).tolist())
    cut = sorted(counts.values(), reverse=True)[DRAFT_VOCAB - 1]
    above = {token for token, count in counts.items() if count > cut}
    ties = [token for token, count in counts.items() if count == cut]  # insertion order
    assert above <= chosen
    assert not {token for token, count in counts.items() if count < cut} & chosen
    # ties go to the first seen (Counter.most_common), not to the lower id as ours
    assert set(ties[: DRAFT_VOCAB - len(above)]) <= chosen
    assert not set(ties[DRAFT_VOCAB - len(above):]) & chosen
    assert vocab.counted_tokens == sum(counts.values())
    assert vocab.coverage == pytest.approx(sum(counts[t] for t in chosen) / sum(counts.values()))
    identity = st.specforge_vocab(SF, data, train, VOCAB, VOCAB, 64)
    assert not identity.d2t.any() and bool(identity.t2d.all())


@pytest.mark.parametrize("fc_norm", [False, True], ids=["eagle3", "fc_norm"])
def test_converted_drafter_gives_specforge_logits_at_every_ttt_step(data_dir, target, tmp_path, fc_norm):
    data, (packed,) = first_batches(data_dir, 1)
    vocab = st.specforge_vocab(SF, data, data.samples, DRAFT_VOCAB, VOCAB, 64)
    device = torch.device("cpu")
    models = st.build_models(SF, target[0], draft_vocab_size=DRAFT_VOCAB, d2t=vocab.d2t, t2d=vocab.t2d,
                             ttt_length=TTT, attention_backend="sdpa", device=device, dtype=torch.float32, seed=0,
                             fc_norm=fc_norm)
    # SpecForge's EAGLE 3.1 configuration: per-aux norms before fc, exported as SGLang's fc_norm alone
    assert (models.draft.fc_norm is not None) == fc_norm and models.drafter_config.fc_norm == fc_norm
    assert not models.drafter_config.norm_output
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # away from the initial values (norms at 1): every weight matters
        for name, param in models.draft.named_parameters():
            if name != "embed_tokens.weight":
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
    converted = st.to_specforge_batch(SF, packed, 64, torch.float32, TTT)
    theirs = st.specforge_logits(SF, models, converted, device)
    assert len(theirs) == TTT
    drafter_dir = st.export_drafter(models, data.manifest, tmp_path / "drafter", torch.float32, "llama")
    state, config = load_export(drafter_dir)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == DRAFT_VOCAB
    assert bool(config.get("fc_norm")) == fc_norm and "norm_output" not in config
    assert ("fc_norm.0.weight" in state) == fc_norm
    assert torch.equal(state["d2t"], vocab.d2t) and torch.equal(state["t2d"], vocab.t2d)
    drafter, _ = load_drafter(drafter_dir, tr.load_target_embeddings(target[0]))
    with torch.no_grad():
        ours = drafter.forward_ttt(packed.input_ids[None], packed.aux_hidden[None].float(),
                                   packed.position_ids[None], TTT, packed.doc_ids[None])
    compared = 0
    for step in range(TTT):
        # rows whose step-k input token x_{t+1+k} lies in their own sample (past it both sides read padding)
        valid = packed.position_ids + 1 + step < torch.tensor(converted.lengths)[converted.rows[0]]
        assert valid.any()
        torch.testing.assert_close(ours[step][0, valid], theirs[step][0, valid], rtol=1e-4, atol=1e-4)
        compared += int(valid.sum())
    assert compared > packed.num_tokens  # several steps of most rows
    # and the comparison can fail: another drafter's logits differ
    with torch.no_grad():
        drafter.lm_head.weight.mul_(1.5)
        other = drafter.forward_ttt(packed.input_ids[None], packed.aux_hidden[None].float(),
                                    packed.position_ids[None], TTT, packed.doc_ids[None])
    assert not torch.allclose(other[0], theirs[0], rtol=1e-4, atol=1e-4)


def test_the_command_trains_exports_and_writes_what_evaluate_reads(data_dir, tmp_path):
    out = tmp_path / "sf"
    command = [sys.executable, str(ROOT / "bench" / "specforge_trainer.py"), "--data-dir", str(data_dir),
               "--output-dir", str(out), "--steps", "4", "--lr", "3e-3", "--batch-tokens", "64", "--seed", "0",
               "--ttt", str(TTT), "--eval-ratio", "0.2", "--draft-vocab-size", str(DRAFT_VOCAB), "--device", "cpu",
               "--specforge-path", SF.path, "--log-every", "1"]
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        for key in ("loss", "loss_k", "acc_k", "cond_acc_k", "acceptance_length", "specforge_loss",
                    "specforge_ploss_k", "specforge_acc_k", "grad_norm", "lr", "tokens", "tokens_per_s"):
            assert key in record, key
        assert len(record["acc_k"]) == len(record["specforge_acc_k"]) == TTT
        assert record["specforge_loss"] == pytest.approx(sum(0.8**k * p for k, p in
                                                             enumerate(record["specforge_ploss_k"])), rel=1e-5)
    # each step's learning rate is SpecForge's BF16Optimizer schedule over --steps (its max_steps)
    schedule = SF.classes["BF16Optimizer"](torch.nn.Linear(2, 2), lr=3e-3, total_steps=4,
                                           warmup_ratio=st.DEFAULTS.warmup_ratio)
    expected = []
    for _ in records:
        expected.append(schedule.get_learning_rate())
        schedule.scheduler.step()
    assert [r["lr"] for r in records] == pytest.approx(expected)
    assert records[-1]["lr"] < records[1]["lr"] < records[0]["lr"]
    # ours' batches: the same samples, in ours' order
    data = open_dataset(data_dir)
    train, _ = data.split(0.2)
    ours = [packed for _, (_, packed) in zip(range(4), batches(data, 64, 0, 0, 1, samples=train, epochs=1))]
    assert [r["tokens"] for r in records] == [p.num_tokens for p in ours]
    training = json.loads((out / "training.json").read_text())
    assert training["steps"] == 4 and training["config"]["data_dir"] == str(Path(data_dir).resolve())
    # what the evaluation compares with (eval, else last): ours' definitions, ours' keys
    evaluation = training["eval"]
    assert evaluation["samples"] >= 1 and len(evaluation["acc_k"]) == len(evaluation["cond_acc_k"]) == TTT
    assert evaluation["acceptance_length"] == pytest.approx(acceptance_length(evaluation["cond_acc_k"]))
    assert training["last"] == records[-1]
    state, config = load_export(out / "drafter")
    assert config["eagle3_pipeline"]["aux_layers"] == data.manifest["aux_layers"]
    # trained: the export is not SpecForge's initial draft
    models = st.build_models(SF, data.manifest["target_model_path"], draft_vocab_size=DRAFT_VOCAB,
                             d2t=state["d2t"], t2d=state["t2d"], ttt_length=TTT, attention_backend="sdpa",
                             device=torch.device("cpu"), dtype=torch.float32, seed=0)
    initial = models.draft.state_dict()
    assert not torch.equal(state["fc.weight"], initial["fc.weight"])
    assert "step 4/4" in result.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: SpecForge's Triton loss and flex attention")
def test_on_cuda_its_triton_loss_is_its_reference_and_flex_attention_gives_the_same_logits(data_dir, target,
                                                                                          tmp_path):
    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 9, DRAFT_VOCAB, generator=generator).to(device)
    target_p = torch.softmax(torch.randn(2, 9, DRAFT_VOCAB, generator=generator), -1).to(device)
    mask = (torch.rand(2, 9, 1, generator=generator) > 0.3).int().to(device)
    reference_in = logits.clone().requires_grad_()
    with torch._dynamo.config.patch(disable=True):
        reference = SF.loss_module._compute_loss(reference_in, target_p, mask)
    (reference_grad,) = torch.autograd.grad(reference, reference_in)
    kernel_in = logits.clone().requires_grad_()  # its backward writes the gradient into the saved logits
    kernel = SF.loss_module.LogSoftmaxLoss.apply(kernel_in, target_p, mask)
    (kernel_grad,) = torch.autograd.grad(kernel, kernel_in)
    torch.testing.assert_close(kernel, reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kernel_grad, reference_grad, rtol=1e-4, atol=1e-7)

    data, (packed,) = first_batches(data_dir, 1)
    vocab = st.specforge_vocab(SF, data, data.samples, DRAFT_VOCAB, VOCAB, 64)
    models = st.build_models(SF, target[0], draft_vocab_size=DRAFT_VOCAB, d2t=vocab.d2t, t2d=vocab.t2d,
                             ttt_length=TTT, attention_backend="flex_attention", device=device,
                             dtype=torch.float32, seed=0)
    converted = st.to_specforge_batch(SF, packed, 64, torch.float32, TTT)
    theirs = st.specforge_logits(SF, models, converted, device)
    drafter_dir = st.export_drafter(models, data.manifest, tmp_path / "drafter", torch.float32, "llama")
    drafter, _ = load_drafter(drafter_dir, tr.load_target_embeddings(target[0]), device)
    on = packed.to(device)
    with torch.no_grad():
        ours = drafter.forward_ttt(on.input_ids[None], on.aux_hidden[None].float(), on.position_ids[None], TTT,
                                   on.doc_ids[None])
    for step in range(TTT):
        valid = (packed.position_ids + 1 + step < torch.tensor(converted.lengths)[converted.rows[0]]).to(device)
        torch.testing.assert_close(ours[step][0, valid], theirs[step][0, valid], rtol=2e-3, atol=2e-3)

    out = tmp_path / "sf"
    command = [sys.executable, str(ROOT / "bench" / "specforge_trainer.py"), "--data-dir", str(data_dir),
               "--output-dir", str(out), "--steps", "3", "--lr", "3e-3", "--batch-tokens", "64", "--seed", "0",
               "--ttt", str(TTT), "--eval-ratio", "0.2", "--draft-vocab-size", str(DRAFT_VOCAB), "--device", "cuda",
               "--specforge-path", SF.path]
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    training = json.loads((out / "training.json").read_text())
    assert training["dtype"] == "bfloat16" and training["specforge"]["attention_backend"] == "flex_attention"
    state, config = load_export(out / "drafter")
    assert config["torch_dtype"] == "bfloat16" and state["fc.weight"].dtype == torch.bfloat16
