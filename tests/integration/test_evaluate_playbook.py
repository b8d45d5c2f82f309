"""playbooks/evaluate.yml through ansible-runner: a drafter of the tiny model measured on held-out demo prompts.

The data comes from test_train_playbook's fixtures (a reference server on the tiny model, 40 demo
conversations extracted); a drafter is trained on it in seconds with the train command; the
playbook then measures it by speculative decoding on 4 held-out demo prompts (reference engine,
CPU) at chains of 3 and 7 drafts, excludes (and lists) training conversations given as held-out
prompts, refuses when too few prompts remain, and fails a drafter that serves far below what its
training predicts while still writing the verdict.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from runner_runs import ROOT, run_project_playbook
from test_train_playbook import CLI, data_dir, tiny_model  # noqa: F401 - fixtures shared with the training test

PLAYBOOK = ROOT / "playbooks" / "evaluate.yml"
INVENTORY = ROOT / "inventory" / "local.yml"


@pytest.fixture(scope="module")
def drafter_run(data_dir, tmp_path_factory) -> Path:  # noqa: F811 - the imported fixture
    """A drafter trained for 8 steps (3 TTT steps, 256-token batches) with a training.json beside it."""
    out = tmp_path_factory.mktemp("drafter-run")
    trained = subprocess.run(
        [*CLI, "train", "--data-dir", str(data_dir), "--output-dir", str(out), "--device", "cpu",
         "--draft-vocab-size", "512", "--ttt-length", "3", "--batch-tokens", "256", "--max-steps", "8",
         "--lr", "3e-3", "--eval-ratio", "0.2", "--no-tensorboard", "--no-charts"],
        capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    return out


def evaluation_vars(drafter_run: Path, out: Path, prompts: Path) -> dict:
    return {"evaluation_drafter_dir": str(drafter_run / "drafter"), "evaluation_training_dir": str(drafter_run),
            "evaluation_output_dir": str(out),
            "evaluation_prompts": str(prompts), "evaluation_num_prompts": 4, "evaluation_max_new_tokens": 16,
            "evaluation_device": "cpu", "evaluation_poll_s": 1}


def _run(tmp_path_factory, extravars: dict, check: bool = False):
    return run_project_playbook(tmp_path_factory.mktemp("runner"), PLAYBOOK, INVENTORY, extravars, check)


def _shown(runner) -> list[str]:
    events = [e for e in runner.events if e.get("event") == "runner_on_ok"
              and e["event_data"]["task"] == "Show the measured and the simulated acceptance length"]
    assert len(events) == 1, runner.stdout.read()
    return events[0]["event_data"]["res"]["msg"]


def test_check_mode_measures_nothing_then_a_run_measures_and_a_rerun_changes_nothing(
    data_dir, drafter_run, tmp_path, tmp_path_factory  # noqa: F811
):
    prompts = data_dir.parent / "train.heldout.jsonl"  # written beside train.jsonl by demo-dataset
    out = tmp_path / "evaluation"
    extravars = evaluation_vars(drafter_run, out, prompts)

    checked = _run(tmp_path_factory, extravars, check=True)
    assert checked.status == "successful", checked.stdout.read()
    assert any("would measure the drafter (reference engine)" in line for line in _shown(checked))
    assert not out.exists()

    first = _run(tmp_path_factory, extravars)
    assert first.status == "successful", first.stdout.read()
    # The measurement ran asynchronously: the controller polled it, no SSH call stayed open for its minutes.
    assert [e for e in first.events if e.get("event") == "runner_on_async_ok"
            and e["event_data"]["task"].startswith("Decode the held-out prompts with the drafter")]
    result = json.loads((out / "evaluation.json").read_text())
    assert result["outputs_match_target"] is True and result["prompts"] == 4
    assert result["reference_check"]["checked"] and result["reference_check"]["faults"] == 0
    assert [run["draft_tokens"] for run in result["runs"]] == [3, 7] and result["draft_tokens"] == 3
    for run in result["runs"]:
        assert run["requests"] == 4 and run["tau"] >= 1.0
        assert run["tau"] == pytest.approx(run["tokens_from_verify"] / run["target_forwards"])
        # A round that produces an end token stops there, so tau can only fall short of 1 + the accepted drafts.
        assert run["tau"] <= 1 + sum(run["accepted_per_position"]) + 1e-9
        # The drafter trained 3 TTT steps: the training predicts chains of up to 3 drafts.
        assert (run["predicted_tau"] is not None) == (run["draft_tokens"] <= 3)
        assert len(run["predicted_conditional_acceptance"]) == min(3, run["draft_tokens"])
        # The replay from full forwards: the same prompts' tokens, and (float32, end tokens aside) the same rounds,
        # unless a float32 near-tie parted an output from the reference decode the replay reads.
        if not [m for m in result["output_mismatches"] if m["draft_tokens"] == run["draft_tokens"]]:
            assert run["replayed"]["tokens_generated"] == run["tokens_generated"]
            assert abs(run["replayed"]["target_forwards"] - run["target_forwards"]) <= run["requests"]
    # The speed-up divides by the target decoding the same prompts alone (same engine and batches, greedy), whose
    # outputs are checked against the full-forward decode with the drafted ones (chain 0 among the mismatches).
    alone = result["target_alone"]
    assert alone["target_forwards"] == alone["tokens_generated"] - 4 and alone["tokens_per_s"] > 0
    for run in result["runs"]:
        assert run["speedup"] == pytest.approx(run["tokens_per_s"] / alone["tokens_per_s"])
    assert not [m for m in result["output_mismatches"] if m["draft_tokens"] == 0 and not m["near_tie"]]
    # The target's answer tokens after the prefill's, each a draft's target, against the drafter's vocabulary.
    reach = result["draft_vocabulary"]
    assert reach["draft_vocab_size"] == 512 and reach["answer_tokens"] == alone["target_forwards"]
    assert 0 <= reach["outside"] <= reach["answer_tokens"]
    assert reach["share_outside"] == pytest.approx(reach["outside"] / reach["answer_tokens"])
    assert [check["draft_tokens"] for check in result["verdict"]["replay"]] == [3, 7]
    assert all(check["ok"] for check in result["verdict"]["replay"])
    assert result["replayed_tau"] == result["runs"][0]["replayed"]["tau"]
    assert result["verdict"]["passed"] and result["excluded_prompts"] == []
    assert result["drafter_sha256"] == json.loads((drafter_run / "drafter" / "config.json").read_text())[
        "eagle3_pipeline"]["weights_sha256"]
    lines = _shown(first)
    assert lines[0].startswith(f"chain of 3: acceptance length (measured) tau {result['runs'][0]['tau']:.2f}, "
                               f"replayed from full forwards {result['runs'][0]['replayed']['tau']:.2f}, "
                               f"training predicts {result['runs'][0]['predicted_tau']:.2f}"), lines
    assert lines[1].startswith("chain of 7: "), lines
    assert f"{result['runs'][0]['speedup']:.2f}x the target alone's" in lines[0], lines
    assert any(line.startswith("the target alone (same engine, prompts and batches, greedy): ") for line in lines)
    # Equal throughout, or parted only at float32 near-ties (two paths may order a near-tie differently).
    assert any(line.startswith("outputs against the target's own greedy decode by full forwards: ") and
               (line.endswith("all equal") or line.endswith(" 0 otherwise")) for line in lines), lines
    assert "verdict: passed" in lines
    assert first.stats["changed"].get("localhost", 0) >= 1
    written = (out / "evaluation.json").stat().st_mtime_ns

    second = _run(tmp_path_factory, extravars)
    assert second.status == "successful", second.stdout.read()
    assert second.stats["changed"].get("localhost", 0) == 0
    assert (out / "evaluation.json").stat().st_mtime_ns == written


def test_training_conversations_among_the_prompts_are_excluded_and_listed(
    data_dir, drafter_run, tmp_path, tmp_path_factory  # noqa: F811
):
    training_lines = (data_dir.parent / "train.jsonl").read_text().splitlines()[:2]
    heldout_lines = (data_dir.parent / "train.heldout.jsonl").read_text().splitlines()
    prompts = tmp_path / "mixed.jsonl"
    prompts.write_text("\n".join([training_lines[0], heldout_lines[0], training_lines[1], *heldout_lines[1:]]) + "\n")
    extravars = {**evaluation_vars(drafter_run, tmp_path / "evaluation", prompts), "evaluation_draft_tokens": [3]}

    measured = _run(tmp_path_factory, extravars)

    assert measured.status == "successful", measured.stdout.read()
    result = json.loads((tmp_path / "evaluation" / "evaluation.json").read_text())
    assert result["prompts"] == 4 and [run["draft_tokens"] for run in result["runs"]] == [3]
    ids = [json.loads(line)["id"] for line in training_lines]
    assert [(e["id"], e["line"], e["reason"]) for e in result["excluded_prompts"]] == [
        (ids[0], 1, "same id as a training sample"), (ids[1], 3, "same id as a training sample")]
    assert not set(ids) & set(result["prompt_ids"])
    assert any("2 excluded: seen in training, repeated or longer than the training's samples" in line
               for line in _shown(measured))


def test_prompts_from_a_mixture_of_sources_with_their_counts(
    data_dir, drafter_run, tmp_path, tmp_path_factory  # noqa: F811
):
    # Two sources: the training's own file (its first 2 records: both excluded, known by their ids without the
    # source's prefix) and the held-out file; evaluation_prompts is the list, as the inventory gives it.
    sources = [{"path": str(data_dir.parent / "train.jsonl"), "name": "seen", "count": 2},
               {"path": str(data_dir.parent / "train.heldout.jsonl"), "name": "held"}]
    extravars = {**evaluation_vars(drafter_run, tmp_path / "evaluation", Path("/unused")),
                 "evaluation_prompts": sources, "evaluation_draft_tokens": [3]}

    measured = _run(tmp_path_factory, extravars)

    assert measured.status == "successful", measured.stdout.read()
    result = json.loads((tmp_path / "evaluation" / "evaluation.json").read_text())
    ids = [json.loads(line)["id"] for line in (data_dir.parent / "train.jsonl").read_text().splitlines()[:2]]
    assert [(e["id"], e["reason"]) for e in result["excluded_prompts"]] == [
        (f"seen.{ids[0]}", "same id as a training sample"), (f"seen.{ids[1]}", "same id as a training sample")]
    assert result["prompts"] == 4 and all(i.startswith("held.") for i in result["prompt_ids"])
    assert [s["name"] for s in json.loads(result["prompts_file"])] == ["seen", "held"]

    sources[1]["path"] = str(tmp_path / "gone.jsonl")
    refused = _run(tmp_path_factory, {**extravars, "evaluation_prompts": sources})
    assert refused.status == "failed"
    messages = [e["event_data"]["res"].get("msg", "") for e in refused.events if e.get("event") == "runner_on_failed"]
    assert any(f"{tmp_path / 'gone.jsonl'} do not exist on this host" in m for m in messages), messages


def test_too_few_prompts_left_after_the_exclusions_refuse_by_name(
    data_dir, drafter_run, tmp_path, tmp_path_factory  # noqa: F811
):
    prompts = tmp_path / "mostly-training.jsonl"
    prompts.write_text("\n".join([*(data_dir.parent / "train.jsonl").read_text().splitlines()[:5],
                                  (data_dir.parent / "train.heldout.jsonl").read_text().splitlines()[0]]) + "\n")
    extravars = evaluation_vars(drafter_run, tmp_path / "evaluation", prompts)

    refused = _run(tmp_path_factory, extravars)

    assert refused.status == "failed"
    messages = [e["event_data"]["res"].get("msg", "") for e in refused.events if e.get("event") == "runner_on_failed"]
    assert any("only 1 usable held-out prompt(s), at least 2 needed: 5 excluded as seen in training, repeated or "
               "too long" in m and
               "demo-00000 (same id as a training sample: demo-00000)" in m for m in messages), messages
    assert not (tmp_path / "evaluation" / "evaluation.json").exists()


def test_a_drafter_far_below_its_training_prediction_fails_with_its_verdict_written(
    data_dir, drafter_run, tmp_path, tmp_path_factory  # noqa: F811
):
    """A training that claims 0.95 at every position and a drafter that serves far below it: the play fails
    after the summary, naming the position and the likely causes; evaluation.json records the verdict."""
    claimed = tmp_path / "claimed-training"
    claimed.mkdir()
    training = json.loads((drafter_run / "training.json").read_text())
    training["eval"] = {**(training.get("eval") or {}), "cond_acc_k": [0.95] * 7}
    (claimed / "training.json").write_text(json.dumps(training))
    out = tmp_path / "evaluation"
    extravars = {**evaluation_vars(drafter_run, out, data_dir.parent / "train.heldout.jsonl"),
                 "evaluation_training_dir": str(claimed), "evaluation_max_new_tokens": 48,
                 "evaluation_min_acceptance_ratio": 1.0}

    failed = _run(tmp_path_factory, extravars)

    assert failed.status == "failed"
    result = json.loads((out / "evaluation.json").read_text())
    assert not result["verdict"]["passed"] and result["verdict"]["likely_causes"]
    assert "draft position 1" in result["verdict"]["problems"][0]
    messages = [e["event_data"]["res"].get("msg", "") for e in failed.events if e.get("event") == "runner_on_failed"]
    assert any("the drafter FAILED its evaluation" in m and "Likely causes" in m for m in messages), messages
    assert any(line.startswith("verdict: FAILED") for line in _shown(failed))
    again = _run(tmp_path_factory, extravars)  # measured already: the same verdict, not a pass
    assert again.status == "failed" and again.stats["changed"].get("localhost", 0) == 0
