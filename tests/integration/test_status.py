"""eagle3_pipeline.status: each stage's state read from an output directory's files."""

from __future__ import annotations

import time

import pytest
from status_fixtures import finished_run, gpu_reset_report, manifest, part_progress, training_progress, write_json

from eagle3_pipeline.status import DONE, FAILED, NOT_STARTED, RUNNING, format_status, pipeline_status


def states(out) -> dict[str, str]:
    return {stage.stage: stage.state for stage in pipeline_status(out)}


def by_stage(out, now: float | None = None) -> dict:
    return {stage.stage: stage for stage in pipeline_status(out, now)}


def test_an_empty_output_directory_has_no_stage_started(tmp_path):
    assert set(states(tmp_path).values()) == {NOT_STARTED}


def test_a_finished_run_is_done_at_every_stage_with_its_figures(tmp_path):
    finished_run(tmp_path)

    stages = by_stage(tmp_path)

    assert {name: s.state for name, s in stages.items()} == {
        "gpu_reset": DONE, "serve": NOT_STARTED, "extract": DONE, "train": DONE, "evaluate": DONE, "report": DONE,
    }  # fmt: skip
    assert stages["gpu_reset"].summary == "gpu-a: 8 GPU(s), 2 process(es) stopped, free in 2.25 s"
    assert stages["extract"].summary == "10 samples, 1,234 tokens, 3.00 GiB, 1 skipped, 0 failed, 3,000 tokens/s"
    assert stages["extract"].paths["data_dir"] == str(tmp_path / "data")
    assert stages["train"].figures["simulated_acceptance_length"] == 2.05
    assert stages["train"].paths["drafter_dir"] == str(tmp_path / "training" / "drafter")
    assert stages["evaluate"].summary == "measured acceptance length 2.40 (simulated 2.05) on 12 prompts"
    assert stages["report"].paths["report"] == str(tmp_path / "report" / "index.html")


def test_the_training_directory_is_found_under_any_name(tmp_path):
    finished_run(tmp_path, training_subdir="drafter-run")

    train = by_stage(tmp_path)["train"]

    assert train.state == DONE
    assert train.paths["training_dir"] == str(tmp_path / "drafter-run")


def test_a_running_extraction_shows_its_progress(tmp_path):
    write_json(tmp_path / "data" / "parts" / "part-0-of-2.progress.json", part_progress("0/2", "running", 3, 10))
    write_json(tmp_path / "data" / "parts" / "part-1-of-2.progress.json", part_progress("1/2", "done", 10, 10))

    extract = by_stage(tmp_path)["extract"]

    assert extract.state == RUNNING
    assert extract.summary.startswith("13/20 samples (65 %), 1 of 2 part(s) running, 1,500 tokens/s, 00:01:30 left")
    assert "no update" not in extract.summary


def test_a_running_job_that_stopped_writing_is_flagged(tmp_path):
    stale = time.time() - 600
    write_json(tmp_path / "data" / "parts" / "part-0-of-1.progress.json",
               part_progress("0/1", "running", 3, 10, updated=stale))

    summary = by_stage(tmp_path, now=stale + 600)["extract"].summary
    assert "(no update for 600 s: is the job still alive?)" in summary


def test_a_failed_extraction_part_shows_its_message(tmp_path):
    write_json(tmp_path / "data" / "parts" / "part-0-of-1.progress.json",
               part_progress("0/1", "failed", 3, 10, message="sample demo-3: cached_tokens 12 != 0"))

    extract = by_stage(tmp_path)["extract"]

    assert extract.state == FAILED
    assert extract.message == "part 0/1: sample demo-3: cached_tokens 12 != 0"


def test_a_running_and_a_failed_training(tmp_path):
    write_json(tmp_path / "training" / "progress.json", training_progress("running", 40, 200))
    assert by_stage(tmp_path)["train"].summary.startswith("step 40/200, loss 3.250, accept len 1.75, 900 tokens/s")

    write_json(tmp_path / "training" / "progress.json", training_progress("failed", 41, 200, "CUDA out of memory"))
    train = by_stage(tmp_path)["train"]
    assert (train.state, train.message, train.summary) == (FAILED, "CUDA out of memory", "failed at step 41/200")


def test_gpus_left_held_fail_the_gpu_reset_stage(tmp_path):
    write_json(tmp_path / "gpu_reset" / "gpu-a.json", gpu_reset_report(left=1, health=["GPU 3: 2 remapped rows"]))

    reset = by_stage(tmp_path)["gpu_reset"]

    assert reset.state == FAILED
    assert reset.message == "gpu-a: 1 holder(s) left running; gpu-a: GPU 3: 2 remapped rows"


def test_a_check_mode_gpu_reset_record_is_not_a_reset(tmp_path):
    write_json(tmp_path / "gpu_reset" / "gpu-a.json", {**gpu_reset_report(stopped=0), "check_mode": True})

    reset = by_stage(tmp_path)["gpu_reset"]

    assert reset.state == NOT_STARTED
    assert reset.summary.endswith("(check mode)")


def test_an_unreadable_evaluation_is_a_failure_that_names_the_file(tmp_path):
    (tmp_path / "evaluation").mkdir()
    (tmp_path / "evaluation" / "evaluation.json").write_text('{"tau": 2.')

    evaluate = by_stage(tmp_path)["evaluate"]

    assert evaluate.state == FAILED
    assert str(tmp_path / "evaluation" / "evaluation.json") in evaluate.message


def test_the_text_has_a_line_per_stage_and_the_messages_under_it(tmp_path):
    write_json(tmp_path / "data" / "data_config.json", manifest())
    write_json(tmp_path / "training" / "progress.json", training_progress("failed", 2, 9, "loss is NaN"))

    lines = format_status(pipeline_status(tmp_path)).splitlines()

    assert [line.split()[0] for line in lines if not line.startswith(" ")] == [
        "gpu_reset", "serve", "extract", "train", "evaluate", "report"]  # fmt: skip
    assert "           ! loss is NaN" in lines


def test_a_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        pipeline_status(tmp_path / "nope")


def test_the_evaluation_names_its_chain_and_compares_the_prediction_at_that_chain(tmp_path):
    """evaluation.json's simulated_acceptance_length is over every draft position the training simulated;
    the status compares the measured tau with the prediction at the chain it was measured at."""
    finished_run(tmp_path)
    write_json(tmp_path / "evaluation" / "evaluation.json",
               {"tau": 2.13, "draft_tokens": 3, "simulated_tau": 3.12, "simulated_acceptance_length": 4.04,
                "prompts": 40})
    summary = by_stage(tmp_path)["evaluate"].summary
    assert summary == ("measured acceptance length 2.13 at 3 drafts per step (the training predicts 3.12 at 3) "
                       "on 40 prompts")
