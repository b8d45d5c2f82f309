"""``eagle3-pipeline run`` and ``eagle3-pipeline status``, run as real subprocesses as an operator runs them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from status_fixtures import finished_run, training_progress, write_json
from test_cli_subprocess import run_cli

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "output" / "demo"
STAGE_NAMES = ["gpu_reset", "serve", "extract", "train", "evaluate", "report"]


def test_run_shows_each_task_result_the_summary_and_a_recap(tmp_path):
    reports = tmp_path / "reports"

    proc = run_cli("run", "gpu-reset", "--check", "-e", f"gpu_reset_report_dir={reports}", cwd=tmp_path)

    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    lines = out.splitlines()
    assert lines[0] == "PLAY Free the GPUs"
    assert "  ok          localhost | gpu_reset : Show the report" in lines
    assert "               gpu_reset on localhost (check mode: nothing signalled)" in lines
    recap = lines.index("RECAP")
    assert re.fullmatch(r"  localhost: ok=\d+  changed=\d+  failed=0  skipped=\d+  unreachable=0  rescued=0  ignored=0",
                        lines[recap + 1])
    # Then where the time went (playbooks/callback_plugins/stage_times.py), the paths and the stage's line.
    assert lines[recap + 2].startswith("STAGE TIMES (wall seconds per role")
    assert re.fullmatch(r"gpu_reset +\d+\.\d s", lines[recap + 3])
    assert re.fullmatch(r"playbook +\d+\.\d s", lines[recap + 4])
    assert lines[recap + 5].startswith("slowest tasks: gpu_reset : ")
    assert len(lines) == recap + 8
    assert lines[-2] == f"gpu_reset_dir: {reports}"
    assert lines[-1].startswith("stage gpu-reset: successful in ")
    assert lines[-1].endswith(" s (check mode: nothing changed)")
    assert "skipping" not in out and "\x1b[" not in out and "\r" not in out
    assert proc.stderr == ""


def test_a_failed_run_exits_non_zero_with_the_task_host_and_message(tmp_path):
    proc = run_cli("run", "gpu-reset", "-e", "gpu_reset_grace_s=soon", cwd=tmp_path)

    assert proc.returncode == 2
    assert proc.stderr.startswith("error: stage gpu-reset (gpu_reset.yml) failed (rc 2):\n"
                                  "  task 'gpu_reset : Validating arguments against arg spec 'main'")
    assert "failed on localhost: Validation of arguments failed" in proc.stderr
    assert "gpu_reset_grace_s" in proc.stderr
    assert "  FAILED      localhost | gpu_reset : Validating arguments" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_an_unknown_stage_is_refused(tmp_path):
    proc = run_cli("run", "deploy", cwd=tmp_path)

    assert proc.returncode == 2
    assert "invalid choice: 'deploy'" in proc.stderr


def test_status_of_a_finished_run(tmp_path):
    out = finished_run(tmp_path / "out")

    proc = run_cli("status", str(out), cwd=tmp_path)

    assert proc.returncode == 0, proc.stderr
    heads = [line.split("  ")[0] for line in proc.stdout.splitlines() if not line.startswith(" ")]
    assert heads == STAGE_NAMES
    assert "extract    done         10 samples, 1,234 tokens, 3.00 GiB, 1 skipped, 0 failed" in proc.stdout
    assert "evaluate   done         measured acceptance length 2.40 (simulated 2.05) on 12 prompts" in proc.stdout
    assert f"report     done         {out / 'report' / 'index.html'}" in proc.stdout


def test_status_as_json_and_a_failed_stage_exits_1(tmp_path):
    out = finished_run(tmp_path / "out")
    write_json(out / "training" / "progress.json", training_progress("failed", 3, 45, "loss is NaN at step 3"))

    proc = run_cli("status", str(out), "--json", cwd=tmp_path)

    assert proc.returncode == 1, proc.stderr
    document = json.loads(proc.stdout)
    assert document["output_dir"] == str(out)
    stages = {stage["stage"]: stage for stage in document["stages"]}
    assert list(stages) == STAGE_NAMES
    assert stages["train"]["state"] == "failed"
    assert stages["train"]["message"] == "loss is NaN at step 3"
    assert stages["extract"]["figures"]["num_samples"] == 10


def test_status_of_a_missing_directory(tmp_path):
    proc = run_cli("status", str(tmp_path / "nope"), cwd=tmp_path)

    assert proc.returncode == 2
    assert f"error: {tmp_path / 'nope'} is not a directory" in proc.stderr


@pytest.mark.skipif(not (DEMO / "data" / "data_config.json").exists(), reason="no output/demo here (run make demo)")
def test_status_of_the_demo_output(tmp_path):
    proc = run_cli("status", str(DEMO), "--json", cwd=tmp_path)

    assert proc.returncode in (0, 1), proc.stderr
    stages = {stage["stage"]: stage for stage in json.loads(proc.stdout)["stages"]}
    assert list(stages) == STAGE_NAMES
    assert stages["extract"]["state"] == "done"
    assert stages["extract"]["figures"]["num_samples"] > 0
