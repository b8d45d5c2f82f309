"""playbooks/evaluate.yml through ansible-runner: a drafter of the tiny model measured on held-out demo prompts.

The data comes from test_train_playbook's fixtures (a reference server on the tiny model, 40 demo
conversations extracted); a drafter is trained on it in seconds with the train command; the
playbook then measures it by speculative decoding on 4 held-out demo prompts (reference engine,
CPU), and refuses training conversations given as held-out prompts.
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
            "evaluation_device": "cpu"}


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
    result = json.loads((out / "evaluation.json").read_text())
    assert result["outputs_match_target"] is True and result["prompts"] == 4
    assert result["tau"] >= 1.0 and result["draft_tokens"] == 3
    assert result["tau"] == pytest.approx(1 + sum(result["accepted_per_position"]))
    assert result["simulated_acceptance_length"] is not None
    assert result["drafter_sha256"] == json.loads((drafter_run / "drafter" / "config.json").read_text())[
        "eagle3_pipeline"]["weights_sha256"]
    lines = _shown(first)
    assert lines[0].startswith(f"acceptance length (measured): tau {result['tau']:.2f} (simulated by training: "
                               f"{1 + result['simulated_acceptance_length']:.2f}), per position "), lines
    assert "output equals the target's own greedy decode token for token: yes" in lines
    assert first.stats["changed"].get("localhost", 0) >= 1
    written = (out / "evaluation.json").stat().st_mtime_ns

    second = _run(tmp_path_factory, extravars)
    assert second.status == "successful", second.stdout.read()
    assert second.stats["changed"].get("localhost", 0) == 0
    assert (out / "evaluation.json").stat().st_mtime_ns == written


def test_training_conversations_given_as_held_out_prompts_are_refused_by_name(
    data_dir, drafter_run, tmp_path, tmp_path_factory  # noqa: F811
):
    extravars = evaluation_vars(drafter_run, tmp_path / "evaluation", data_dir.parent / "train.jsonl")

    refused = _run(tmp_path_factory, extravars)

    assert refused.status == "failed"
    messages = [e["event_data"]["res"].get("msg", "") for e in refused.events if e.get("event") == "runner_on_failed"]
    assert any("held-out prompt(s) are in the training data" in m and "demo-00000 (same id as training sample "
               "demo-00000)" in m for m in messages), messages
    assert not (tmp_path / "evaluation" / "evaluation.json").exists()
