"""The training loop on the CPU: a tiny random Llama target, its real hidden states stored with the
extraction's store, loss going down, exact resume, pickle-free checkpoints, export round trip."""

from __future__ import annotations

import json
import shutil
import statistics
import time

import pytest
import torch
from train_fixtures import HIDDEN, NUM_SAMPLES, VOCAB, build_data, build_target

from eagle3_pipeline.extract.convert import ConvertConfig, convert_storage
from eagle3_pipeline.train import export as ex
from eagle3_pipeline.train import trainer as tr
from eagle3_pipeline.train.data import DataError, pack
from eagle3_pipeline.train.model import DrafterConfigError, Eagle3Drafter
from eagle3_pipeline.train.vocab import VocabError

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return build_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, target_dir):
    return build_data(tmp_path_factory.mktemp("extracted"), *target_dir)


def config(data_dir, out, **overrides):
    base = {"data_dir": str(data_dir), "output_dir": str(out), "draft_vocab_size": 48, "ttt_length": 3,
            "epochs": 6, "lr": 3e-3, "warmup_steps": 2, "batch_tokens": 64, "eval_ratio": 0.2, "seed": 0,
            "checkpoint_every": 4}
    return tr.TrainConfig(**{**base, **overrides})


def train_losses(out):
    lines = [json.loads(line) for line in (out / tr.METRICS_FILE).read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in lines if r["kind"] == "train"]


def test_loss_decreases_and_metrics_are_logged(data_dir, tmp_path):
    began = time.perf_counter()
    result = tr.train(config(data_dir, tmp_path, max_steps=30))
    wall = time.perf_counter() - began
    losses = [loss for _, loss in train_losses(tmp_path)]
    assert result["steps"] == len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    records = [json.loads(line) for line in (tmp_path / tr.METRICS_FILE).read_text().splitlines()]
    first = records[0]
    for key in ("step", "epoch", "loss", "loss_k", "acc_k", "cond_acc_k", "acceptance_length", "tokens",
                "tokens_per_s", "lr"):
        assert key in first
    assert len(first["loss_k"]) == len(first["acc_k"]) == 3
    assert any(r["kind"] == "eval" for r in records)
    assert sorted(p.name for p in tmp_path.joinpath("checkpoints").iterdir()) == ["step-28", "step-30"]
    # Each step's tokens/s over its own time: the steps' times are disjoint spans of the run, and none is a
    # sliver (the last step was once timed from the read of the one before it: millions of tokens/s).
    seconds = [r["tokens"] / r["tokens_per_s"] for r in records if r["kind"] == "train"]
    assert sum(seconds) <= wall
    assert min(seconds) > 0.2 * statistics.median(seconds)


def test_resume_gives_exactly_the_uninterrupted_losses(data_dir, tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    tr.train(config(data_dir, whole, max_steps=11))
    tr.train(config(data_dir, parts, max_steps=5))
    # A kill -9 after the last checkpoint: lines past it are logged, then a newer partial checkpoint dir.
    with open(parts / tr.METRICS_FILE, "a") as handle:
        handle.write(json.dumps({"kind": "train", "step": 6, "loss": 123.0}) + "\n{\"kind\": \"tr")
    partial = parts / "checkpoints" / "step-9"
    shutil.copytree(parts / "checkpoints" / "step-5", partial)
    data = (partial / tr.MODEL_FILE).read_bytes()
    (partial / tr.MODEL_FILE).write_bytes(data[: len(data) // 2])
    result = tr.train(config(data_dir, parts, max_steps=11))
    assert result["resumed_from"].endswith("step-5")
    assert train_losses(parts) == train_losses(whole)
    assert [s for s, _ in train_losses(parts)] == list(range(1, 12))


def test_checkpoints_hold_no_pickle(data_dir, tmp_path):
    tr.train(config(data_dir, tmp_path, max_steps=4))
    ckpt = tmp_path / "checkpoints" / "step-4"
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == sorted([tr.MODEL_FILE, tr.OPTIMIZER_FILE, tr.RNG_FILE, tr.STATE_FILE])
    for path in ckpt.iterdir():
        head = path.read_bytes()[:2]
        assert head != b"\x80\x02" and not head.startswith(b"PK")  # neither a pickle nor a torch.save zip
    state = json.loads((ckpt / tr.STATE_FILE).read_text())
    assert state["step"] == 4 and state["data"]["batch"] >= 0


def _exported_drafts_as_checkpointed(out, step: int) -> Eagle3Drafter:
    """The export, loaded as the evaluation loads it, gives the logits of the checkpoint it came from."""
    from eagle3_pipeline.evaluate.speculative import load_drafter

    embed = torch.randn(VOCAB, HIDDEN)
    drafter, _ = load_drafter(out / "drafter", embed)
    ckpt = tr.load_checkpoint(out / "checkpoints" / f"step-{step}")[1]
    trained = Eagle3Drafter(drafter.config, ckpt["d2t"], ckpt["t2d"])
    trained.load_state_dict(ckpt, strict=False)
    trained.load_target_embeddings(embed)
    ids, aux = torch.randint(0, VOCAB, (1, 10)), torch.randn(1, 10, 3 * HIDDEN)
    with torch.no_grad():
        for a, b in zip(drafter.forward_ttt(ids, aux, ttt_length=3), trained.forward_ttt(ids, aux, ttt_length=3)):
            assert torch.equal(a, b)
    return drafter


def test_export_loads_back_and_gives_the_same_logits(data_dir, tmp_path):
    tr.train(config(data_dir, tmp_path, max_steps=3))
    state, _ = ex.load_export(tmp_path / "drafter")
    assert "embed_tokens.weight" not in state
    _exported_drafts_as_checkpointed(tmp_path, 3)


def test_an_eagle3_1_drafter_trains_exports_for_sglang_and_drafts_as_it_trained(data_dir, tmp_path):
    tr.train(config(data_dir, tmp_path, max_steps=2))  # an eagle3 drafter first: both forms written
    speculators = tmp_path / "drafter-speculators"
    assert (speculators / ex.CONFIG_FILE).is_file()
    result = tr.train(config(data_dir, tmp_path, max_steps=3, variant="eagle3.1", resume=False))
    config_json = json.loads((tmp_path / "drafter" / ex.CONFIG_FILE).read_text())
    assert (config_json["fc_norm"], config_json["norm_output"]) == (True, True)
    assert "norm_before_fc" not in config_json and config_json[ex.PROVENANCE_KEY]["variant"] == "eagle3.1"
    # vLLM's speculators form has no EAGLE 3.1 norms: not written, and the result says why.
    assert result["speculators_dir"] is None and "EAGLE 3.1" in result["speculators_note"]
    # The eagle3 run's speculators form is gone: it would have been served as this drafter.
    assert "was removed" in result["speculators_note"] and not speculators.exists()
    drafter = _exported_drafts_as_checkpointed(tmp_path, 3)  # what the evaluation drafts with
    assert drafter.config.fc_norm and drafter.config.norm_output and len(drafter.fc_norm) == 3
    # Another variant is another drafter: its checkpoints are not resumed, and the message says what changed.
    with pytest.raises(tr.TrainConfigError, match="variant 'eagle3.1' -> 'eagle3'"):
        tr.train(config(data_dir, tmp_path, max_steps=3))
    again = tr.train(config(data_dir, tmp_path, max_steps=3, resume=False))
    assert again["steps"] == 3 and "fc_norm" not in json.loads((tmp_path / "drafter" / ex.CONFIG_FILE).read_text())


def test_the_drafter_starts_from_the_targets_lm_head_and_final_norm(data_dir, target_dir, tmp_path):
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    path, model = target_dir
    target = tmp_path / "target"  # the same target, with a final norm that is not all ones so that its copy shows
    shutil.copytree(path, target)
    weights = load_file(target / "model.safetensors")
    weights["model.norm.weight"] = torch.linspace(0.5, 1.5, HIDDEN)
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})

    def exported_head(out, **overrides):  # one step at a learning rate too small to move anything measurably
        tr.train(config(data_dir, out, target_model_path=str(target), max_steps=1, lr=1e-12, warmup_steps=0,
                        **overrides))
        state, _ = ex.load_export(out / "drafter")
        ids = state["d2t"] + torch.arange(state["d2t"].numel())
        return state, model.lm_head.weight.detach()[ids]

    state, rows = exported_head(tmp_path / "target-head", head_init="target", teacher_temperature=0.5)
    torch.testing.assert_close(state["lm_head.weight"], rows, atol=1e-6, rtol=0)
    torch.testing.assert_close(state["norm.weight"], torch.linspace(0.5, 1.5, HIDDEN), atol=1e-6, rtol=0)
    record = json.loads((tmp_path / "target-head" / tr.TRAINING_FILE).read_text())
    assert (record["config"]["head_init"], record["config"]["teacher_temperature"]) == ("target", 0.5)
    state, rows = exported_head(tmp_path / "random-head")  # the default: EAGLE-3's and SpecForge's start
    assert (state["lm_head.weight"] - rows).abs().max() > 0.1 and torch.equal(state["norm.weight"],
                                                                              torch.ones(HIDDEN))
    record = json.loads((tmp_path / "random-head" / tr.TRAINING_FILE).read_text())
    assert (record["config"]["head_init"], record["config"]["teacher_temperature"]) == ("random", 1.0)
    # A run of the other recipe is another drafter: not resumed, and the message says what changed.
    with pytest.raises(tr.TrainConfigError, match="head_init 'random' -> 'target'"):
        tr.train(config(data_dir, tmp_path / "random-head", target_model_path=str(target), max_steps=2, lr=1e-12,
                        head_init="target"))
    with pytest.raises(tr.TrainConfigError, match="head_init must be one of target, random"):
        config(data_dir, tmp_path, head_init="zeros")
    with pytest.raises(tr.TrainConfigError, match="teacher_temperature must be a positive number"):
        config(data_dir, tmp_path, teacher_temperature=0)


def test_the_step_decay_weighs_each_ttt_step_of_the_loss(data_dir, tmp_path):
    def records(out, **overrides):
        tr.train(config(data_dir, out, max_steps=2, eval_ratio=0.25, **overrides))
        lines = [json.loads(line) for line in (out / tr.METRICS_FILE).read_text().splitlines()]
        return [r for r in lines if r["kind"] in ("train", "eval")], json.loads((out / tr.TRAINING_FILE).read_text())

    def weighted(record, decay):
        return sum(decay**k * part for k, part in enumerate(record["loss_k"]))

    for decay, out in ((0.5, tmp_path / "default"), (0.8, tmp_path / "eagle3")):
        lines, training = records(out, **({"step_decay": decay} if decay != 0.5 else {}))
        assert {r["kind"] for r in lines} == {"train", "eval"} and training["config"]["step_decay"] == decay
        for record in lines:  # the loss logged (and descended) is the steps' CE weighed by decay ** k
            assert record["loss"] == pytest.approx(weighted(record, decay), rel=1e-5), record
            assert record["loss"] != pytest.approx(weighted(record, 1.3 - decay), rel=1e-3), record
    with pytest.raises(tr.TrainConfigError, match="step_decay must be a positive number"):
        config(data_dir, tmp_path, step_decay=0)


def test_a_run_begun_at_another_step_decay_is_refused_not_finished_at_the_default(data_dir, tmp_path):
    out = tmp_path / "run"
    tr.train(config(data_dir, out, step_decay=0.8, max_steps=4))  # EAGLE-3's weighing, the default before
    assert tr.make_plan(config(data_dir, out, step_decay=0.8)).fingerprint \
        != tr.make_plan(config(data_dir, out)).fingerprint  # so the finished run is not taken as the default's
    with pytest.raises(tr.TrainConfigError, match=r"step_decay 0.8 -> 0.5.*the same settings, or resume: false"):
        tr.train(config(data_dir, out, max_steps=8))
    # A checkpoint written before the decay was recorded was trained at 0.8: refused at 0.5, resumed at 0.8.
    state_file = out / "checkpoints" / "step-4" / tr.STATE_FILE
    state = json.loads(state_file.read_text())
    del state["fixed"]["step_decay"]
    state_file.write_text(json.dumps(state))
    with pytest.raises(tr.TrainConfigError, match=r"step_decay 0.8 -> 0.5"):
        tr.train(config(data_dir, out, max_steps=8))
    assert tr.train(config(data_dir, out, step_decay=0.8, max_steps=8))["steps"] == 8
    steps = [step for step, _ in train_losses(out)]
    assert steps == list(range(1, 9)), steps  # steps 5-8 continued the checkpoint; nothing trained twice


def test_a_global_batch_accumulates_batches_per_step_and_is_fixed_for_a_resume(data_dir, tmp_path):
    plain = tr.make_plan(config(data_dir, tmp_path / "plain"))
    plan = tr.make_plan(config(data_dir, tmp_path / "global", global_batch_tokens=128))  # 2 batches of 64 per step
    assert (plain.accumulate, plan.accumulate) == (1, 2)
    assert plan.total == sum(len(pack(plain.train_samples, 64, 0, e)) // 2 for e in range(6))
    result = tr.train(config(data_dir, tmp_path / "global", global_batch_tokens=128, max_steps=4))
    records = [json.loads(line) for line in (tmp_path / "global" / tr.METRICS_FILE).read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train"]
    sizes = {sample.index: min(sample.tokens, 64) for sample in plan.train_samples}
    packed = []  # every epoch's batches, each epoch cut to whole steps of 2
    for epoch in range(6):
        epoch_batches = pack(plan.train_samples, 64, 0, epoch)
        packed += [sum(sizes[i] for i in batch) for batch in epoch_batches[: len(epoch_batches) // 2 * 2]]
    assert result["steps"] == len(steps) == 4
    assert [r["tokens"] for r in steps] == [packed[2 * s] + packed[2 * s + 1] for s in range(4)]
    with pytest.raises(tr.TrainConfigError, match="accumulate 2 -> 1"):
        tr.train(config(data_dir, tmp_path / "global", max_steps=6))
    with pytest.raises(tr.TrainConfigError, match=r"global_batch_tokens 96 is not a multiple of batch_tokens 64 x 1"):
        tr.make_plan(config(data_dir, tmp_path / "odd", global_batch_tokens=96))


def test_max_train_samples_trains_on_the_first_samples_only_with_their_own_vocabulary(data_dir, tmp_path):
    from eagle3_pipeline.extract.store import count_tokens
    from eagle3_pipeline.train.vocab import build_draft_vocab

    whole = tr.make_plan(config(data_dir, tmp_path / "whole"))
    plan = tr.make_plan(config(data_dir, tmp_path / "first", max_train_samples=5))
    assert plan.train_samples == whole.train_samples[:5] and len(whole.train_samples) > 5
    assert plan.held == whole.held  # the same held-out split, so the curves compare
    subset_counts = count_tokens(data_dir, (s.file for s in whole.train_samples[:5]), VOCAB)
    assert torch.equal(plan.vocab.d2t, build_draft_vocab(subset_counts, 48).d2t)
    assert not torch.equal(plan.vocab.d2t, whole.vocab.d2t)  # counted over these 5, not the whole extraction
    assert plan.fingerprint != whole.fingerprint
    result = tr.train(config(data_dir, tmp_path / "first", max_train_samples=5, epochs=1, checkpoint_every=0))
    records = [json.loads(line) for line in (tmp_path / "first" / tr.METRICS_FILE).read_text().splitlines()]
    trained = sum(r["tokens"] for r in records if r["kind"] == "train")
    assert trained == sum(min(s.tokens, 64) for s in whole.train_samples[:5])  # each sample once, and no other
    assert result["steps"] == len(pack(whole.train_samples[:5], 64, 0, 0))
    assert (result["train_samples"], result["eval_samples"]) == (5, len(whole.held))
    assert result["train_tokens"] == sum(s.tokens for s in whole.train_samples[:5])
    # More than there are: all of them (said in the log), the same samples as no limit.
    assert tr.make_plan(config(data_dir, tmp_path / "all", max_train_samples=10_000)).train_samples \
        == whole.train_samples
    with pytest.raises(tr.TrainConfigError, match="max_train_samples 5 -> 6"):
        tr.train(config(data_dir, tmp_path / "first", max_train_samples=6, epochs=1, checkpoint_every=0))
    with pytest.raises(tr.TrainConfigError, match="max_train_samples must be an integer >= 1"):
        config(data_dir, tmp_path, max_train_samples=0)


@pytest.fixture(scope="module")
def deepseek_data_dir(tmp_path_factory):
    target = build_target(tmp_path_factory.mktemp("deepseek-v3") / "target", deepseek=True)
    # SGLang captures a DeepSeek target's layer outputs from layer 1 on (serve/sglang_command.py).
    return build_data(tmp_path_factory.mktemp("deepseek-extracted"), *target, aux=[1, 2, 3])


def test_a_deepseek_v3_target_trains_the_mla_drafter_that_sglang_serves_for_kimi(deepseek_data_dir, tmp_path):
    result = tr.train(config(deepseek_data_dir, tmp_path, max_steps=3, variant="eagle3.1"))
    config_json = json.loads((tmp_path / "drafter" / ex.CONFIG_FILE).read_text())
    assert config_json["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config_json["kv_lora_rank"] == 8
    assert config_json["rope_scaling"]["rope_type"] == "yarn" and config_json["fc_norm"] is True
    assert config_json["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]  # DeepSeek's: ours + 1
    assert result["speculators_dir"] is None and "multi-latent attention" in result["speculators_note"]
    drafter = _exported_drafts_as_checkpointed(tmp_path, 3)
    assert drafter.config.layout == "mla" and drafter.config.q_lora_rank == 16
    # A Llama drafter cannot follow this target's YaRN: refused by name before anything runs.
    with pytest.raises(DrafterConfigError, match="rope type 'yarn' is not supported by the llama layout"):
        tr.train(config(deepseek_data_dir, tmp_path, max_steps=3, variant="eagle3.1", layout="llama"))


def test_bad_inputs_fail_clearly(data_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="data_config.json"):
        tr.train(config(empty, tmp_path / "a"))
    with pytest.raises(VocabError, match="larger than the target's vocabulary"):
        tr.train(config(data_dir, tmp_path / "b", draft_vocab_size=VOCAB + 1))
    with pytest.raises(tr.TrainConfigError, match="eval_ratio"):
        config(data_dir, tmp_path, eval_ratio=1.5)
    with pytest.raises(tr.TrainConfigError, match="lr"):
        config(data_dir, tmp_path, lr=0)
    with pytest.raises(tr.TrainConfigError, match="ttt_length"):
        config(data_dir, tmp_path, ttt_length=0)


def test_an_unset_batch_is_chosen_by_the_drafters_width(data_dir, tmp_path):
    from eagle3_pipeline.train.trainer import auto_batch_tokens, make_plan

    assert [auto_batch_tokens(h) for h in (576, 1024, 2048, 4096, 7168)] == [32768, 32768, 8192, 2048, 2048]
    plan = make_plan(config(data_dir, tmp_path / "out", batch_tokens=None))
    assert plan.cfg.batch_tokens == auto_batch_tokens(plan.drafter_config.hidden_size) == 32768
    assert plan.fixed["batch_tokens"] == 32768  # a resume checks the batch it actually used


def test_training_from_float8_data_follows_the_unquantized_run(data_dir, tmp_path):
    fp8 = tmp_path / "fp8"
    assert convert_storage(ConvertConfig(data_dir, copy_to=fp8, quiet=True))["converted"] == NUM_SAMPLES

    tr.train(config(data_dir, tmp_path / "float32", max_steps=20))
    tr.train(config(fp8, tmp_path / "float8", max_steps=20))

    reference, quantized = train_losses(tmp_path / "float32"), train_losses(tmp_path / "float8")
    assert [step for step, _ in quantized] == [step for step, _ in reference] == list(range(1, 21))
    differences = [abs(q - r) / r for (_, q), (_, r) in zip(quantized, reference, strict=True)]
    assert 0 < max(differences) < 0.05, differences
    losses = [loss for _, loss in quantized]
    assert sum(losses[-5:]) < 0.85 * sum(losses[:5])


def test_the_held_out_split_is_scored_over_served_first_answers_too(data_dir, tmp_path):
    # Every fixture sample is one assistant turn after 3 prompt tokens; with the whole draft vocabulary
    # every valid row is scored. Step 0 scores row t on token t + 2, so a sample of T tokens has T - 3
    # rows over every assistant token, T - 4 over tokens 2.. of the answer, N - 1 over tokens 2..N.
    plan = tr.make_plan(config(data_dir, tmp_path / "plan", draft_vocab_size=VOCAB))
    lengths = [sample.tokens for sample in plan.held]
    assert lengths
    whole = tr.train(config(data_dir, tmp_path / "a", draft_vocab_size=VOCAB, max_steps=4,
                            eval_opening_tokens=1000))["eval"]
    assert whole["opening"]["tokens"] == 1000 and whole["opening"]["rows"] == sum(t - 4 for t in lengths)
    assert len(whole["opening"]["cond_acc_k"]) == len(whole["cond_acc_k"]) == 3
    short = tr.train(config(data_dir, tmp_path / "b", draft_vocab_size=VOCAB, max_steps=4,
                            eval_opening_tokens=5))["eval"]
    assert short["opening"]["rows"] == 4 * len(lengths)
    # Walked round by round for every chain length up to the TTT steps: every answer's tokens, the first one
    # from the prefill and the rest from verify rounds (each round at least one).
    walked = whole["opening"]["rounds"]
    assert sorted(walked) == ["1", "2", "3"]
    for chain, figures in walked.items():
        assert (figures["requests"], figures["tokens_generated"], figures["tokens_from_verify"]) == (
            len(lengths), sum(t - 3 for t in lengths), sum(t - 4 for t in lengths))
        assert len(figures["conditional_acceptance_per_position"]) == int(chain)
        assert len(lengths) <= figures["target_forwards"] <= figures["tokens_from_verify"]
    assert all(figures["tokens_generated"] == 5 * len(lengths) for figures in short["opening"]["rounds"].values())
    # The same weights (same seed and steps): the whole split's figures do not depend on the opening's.
    assert short["acc_k"] == whole["acc_k"] and short["loss"] == whole["loss"]
    assert "opening" not in tr.train(config(data_dir, tmp_path / "c", max_steps=4, eval_opening_tokens=0))["eval"]
