"""playbooks/report.yml through ansible-runner on localhost, over a small run's outputs.

The run's outputs are tiny files in the stages' real shapes (tests/unit/report_fixtures.py);
the GPU reset logs sit in a "controller" directory of their own, as the gpu_reset role leaves
them, and the role copies them beside the report.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from runner_runs import ROOT, run_project_playbook

sys.path.insert(0, str(ROOT / "tests" / "unit"))
from report_fixtures import SECRET, make_run  # noqa: E402

PLAYBOOK = ROOT / "playbooks" / "report.yml"
INVENTORY = ROOT / "inventory" / "local.yml"


def play(tmp_path: Path, name: str, extravars: dict, check: bool = False):
    (tmp_path / name).mkdir()
    runner = run_project_playbook(tmp_path / name, PLAYBOOK, INVENTORY, extravars, check=check)
    stdout = runner.stdout.read()
    assert runner.status == "successful", stdout
    return runner.stats, " ".join(stdout.split())  # the YAML callback folds long lines


def test_report_playbook_writes_once_then_changes_nothing_and_check_writes_nothing(tmp_path):
    out = make_run(tmp_path / "run")
    controller_logs = tmp_path / "controller" / "gpu_reset"
    controller_logs.parent.mkdir(parents=True)
    (out / "gpu_reset").rename(controller_logs)
    extravars = {"report_output_dir": str(out), "gpu_reset_report_dir": str(controller_logs),
                 "extraction_output_dir": str(out / "data"), "eagle_training_output_dir": str(out / "drafter-run"),
                 # inventory/local.yml points these at output/demo: the run's own places here.
                 "eagle_training_drafter_dir": "", "evaluation_output_dir": str(out / "evaluation"),
                 "sglang_server_api_key": SECRET, "sglang_server_model_path": "/models/target"}

    stats, stdout = play(tmp_path, "check", extravars, check=True)
    # Check mode reports the change it would make, and makes none.
    assert stats["changed"] == {"localhost": 1}
    assert not (out / "report").exists() and not (out / ".report-inputs").exists()
    assert "would be rewritten" in stdout

    stats, stdout = play(tmp_path, "first", extravars)
    assert stats["changed"] == {"localhost": 1}
    index = out / "report" / "index.html"
    assert f"report: {index} (written)" in stdout and "acceptance length: 1.9" in stdout
    page = index.read_text()
    assert "gpu-node-2" in page and "first signal to verified free: 1.21 s" in page
    assert "sglang_server_model_path" in page and "report_output_dir" in page
    assert SECRET not in page and SECRET not in stdout
    assert json.loads((out / "report" / "report.json").read_text())["summary"]["measured_tau"] == 1.9

    stats, stdout = play(tmp_path, "again", extravars)
    assert stats["changed"] == {}, stdout
    assert f"report: {index} (unchanged)" in stdout
    assert "verdict: PASSED: Measured acceptance within what the training predicts" in stdout
    assert "no check failed" not in stdout and "FAILED:" not in stdout
    # After the recap, the role's wall time (playbooks/callback_plugins/stage_times.py, found under ansible-runner).
    assert re.search(r"PLAY RECAP .* STAGE TIMES \(wall seconds per role.* report +[0-9]+\.[0-9] s .*playbook +"
                     r"[0-9]+\.[0-9] s slowest tasks: report : ", stdout), stdout

    # A drafter that failed its evaluation: the role's message says what failed and why, not only the page.
    evaluation = json.loads((out / "evaluation" / "evaluation.json").read_text())
    problem = ("chain of 3, draft position 1: accepted in 2 of 100 rounds that reached it (0.020; 99 % upper bound "
               "0.070), while the training's held-out split predicts 0.600 (the check asks for at least 0.5 of that)")
    evaluation["verdict"].update(passed=False, problems=[problem])
    evaluation["verdict"]["positions"][0].update(measured=0.02, upper_99=0.07, ok=False)
    (out / "evaluation" / "evaluation.json").write_text(json.dumps(evaluation))
    stats, stdout = play(tmp_path, "failed", extravars)
    stdout = stdout.replace("''", "'")  # the YAML callback's quoting
    assert "verdict: FAILED: Failed: " in stdout
    assert ("FAILED: Measured acceptance against the training's simulation (evaluation verdict): 1 draft position of 2 "
            "judged below 0.5 of what the training's held-out split predicts") in stdout
    assert f"FAILED: evaluation: {problem}" in stdout
