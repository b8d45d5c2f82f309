"""eagle3_pipeline.run: real ansible-runner runs of the project's playbooks on localhost.

The gpu_reset stage is the quick one: there is no GPU here and inventory/local.yml sets
``gpu_reset_required: false``, so a run takes seconds and, in check mode, signals nothing.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runner_runs import run_project_playbook

import eagle3_pipeline
from eagle3_pipeline.run_display import ProgressDisplay
from eagle3_pipeline.runner import PATHS_STATS_KEY, produced_paths, simplify_event

ROOT = Path(__file__).resolve().parents[2]
INVENTORY = ROOT / "inventory" / "local.yml"
HOST = "localhost"


@pytest.fixture(scope="module")
def checked_reset():
    """One check-mode run of the gpu-reset stage: (result, the simplified events on_event got)."""
    received: list[dict] = []
    result = eagle3_pipeline.run("gpu-reset", inventory=INVENTORY, check=True, on_event=received.append)
    return result, received


def test_importing_the_package_loads_no_ansible_code():
    code = ("import sys, eagle3_pipeline; assert callable(eagle3_pipeline.run); "
            "print(sorted(m for m in sys.modules if m.startswith(('ansible', 'ansible_runner'))))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)

    assert proc.stdout.strip() == "[]"


def test_a_check_run_succeeds_with_per_host_stats(checked_reset):
    result, _ = checked_reset

    assert (result.status, result.rc, result.ok, result.check) == ("successful", 0, True, True)
    assert result.playbook == ROOT / "playbooks" / "gpu_reset.yml"
    assert list(result.stats) == [HOST]
    stats = result.stats[HOST]
    assert stats.ok > 0 and stats.skipped > 0
    assert (stats.failed, stats.unreachable, stats.changed) == (0, 0, 0)
    assert result.failures == []


def test_events_arrive_in_order_from_start_to_recap(checked_reset):
    result, received = checked_reset

    counters = [event["counter"] for event in received]
    assert counters == sorted(counters)
    kinds = [event["kind"] for event in received]
    assert kinds[:3] == ["start", "play", "task"]
    # The recap ends the play's events; only the lines of where the time went follow it
    # (playbooks/callback_plugins/stage_times.py).
    recap = kinds.index("recap")
    assert received[recap]["stats"] == {HOST: vars(result.stats[HOST])}
    after = received[recap + 1:]
    assert after and {event["kind"] for event in after} == {"output"}
    assert after[0]["message"].startswith("STAGE TIMES (wall seconds per role")
    assert re.search(r"^playbook +\d+\.\d s$", "\n".join(e["message"] for e in after), re.M)
    # Every host result follows the start of its own task.
    current = None
    for event in received:
        if event["kind"] == "task":
            current = event["task"]
        elif event["kind"] in ("ok", "changed", "skipped", "failed"):
            assert (event["task"], event["host"]) == (current, HOST)
    summary = [e for e in received if e["task"] == "Show the report" and e["kind"] == "ok"]
    assert len(summary) == 1
    assert summary[0]["message"].startswith(f"gpu_reset on {HOST} (check mode: nothing signalled)\n")


def test_a_bad_variable_type_raises_pipeline_error_naming_task_host_and_variable():
    with pytest.raises(eagle3_pipeline.PipelineError) as caught:
        eagle3_pipeline.run("gpu-reset", inventory=INVENTORY, extravars={"gpu_reset_grace_s": "soon"})

    message = str(caught.value)
    assert message.startswith("stage gpu-reset (gpu_reset.yml) failed (rc 2):\n")
    assert "task 'gpu_reset : Validating arguments against arg spec 'main'" in message
    assert f"failed on {HOST}: Validation of arguments failed" in message
    assert "gpu_reset_grace_s" in message
    result = caught.value.result
    assert (result.status, result.rc, result.stats[HOST].failed) == ("failed", 2, 1)
    (failure,) = result.failures
    assert (failure.host, failure.role, failure.recovered) == (HOST, "gpu_reset", False)


def test_a_real_run_reports_the_paths_it_wrote(tmp_path):
    reports = tmp_path / "gpu_reset"

    result = eagle3_pipeline.run("gpu-reset", inventory=INVENTORY, extravars={"gpu_reset_report_dir": str(reports)},
                                 private_data_dir=tmp_path / "runner")

    assert result.ok
    assert result.paths == {"gpu_reset_dir": str(reports)}
    assert json.loads((reports / f"{HOST}.json").read_text())["host"] == HOST
    # The artifacts stay where asked.
    assert list((tmp_path / "runner" / "artifacts").glob("*/job_events/*.json"))


def test_tags_and_skip_tags_select_the_roles_of_a_stage():
    # train.yml tags its roles gpu_reset and eagle_training: only the reset is left to run, after the
    # install check (the eagle3 role, tagged always: every stage runs in the venv it checks).
    seen: list[dict] = []

    result = eagle3_pipeline.run("train", inventory=INVENTORY, tags=["gpu_reset", "eagle_training"],
                                 skip_tags="eagle_training", check=True, on_event=seen.append)

    assert result.ok
    assert {event["role"] for event in seen if event["kind"] == "task"} == {"eagle3", "gpu_reset"}


def test_a_limit_that_matches_no_host_fails_with_ansibles_own_words():
    with pytest.raises(eagle3_pipeline.PipelineError, match="--limit leaves us with no hosts to target"):
        eagle3_pipeline.run("gpu-reset", inventory=INVENTORY, limit="no-such-host", check=True)


def test_an_unknown_stage_and_a_missing_inventory_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown stage 'deploy': expected one of ") as unknown:
        eagle3_pipeline.run("deploy")
    named = str(unknown.value).split("expected one of ", 1)[1].split(", ")
    assert named == list(eagle3_pipeline.STAGES) and {"site", "regenerate", "evaluate"} <= set(named)
    with pytest.raises(FileNotFoundError, match=f"inventory {tmp_path / 'none.yml'} does not exist"):
        eagle3_pipeline.run("gpu-reset", inventory=tmp_path / "none.yml")


def test_a_missing_playbook_is_named(monkeypatch, tmp_path):
    monkeypatch.setitem(eagle3_pipeline.STAGES, "evaluate", "not-written-yet.yml")

    with pytest.raises(FileNotFoundError, match=r"stage 'evaluate' needs playbooks/not-written-yet.yml"):
        eagle3_pipeline.run("evaluate")


def test_a_progress_modules_lines_become_progress_events(tmp_path):
    # The job_progress action plugin prints one line per poll; ansible-runner hands it over
    # as a 'verbose' event of the task. A finished training's progress.json is all it reads.
    out = tmp_path / "training"
    out.mkdir()
    (out / "progress.json").write_text(json.dumps({
        "state": "done", "step": 5, "total_steps": 5, "limit_steps": 5, "epoch": 1, "loss": 2.5,
        "acc_k": [0.5, 0.4, 0.3], "acceptance_length": 1.9, "tokens_per_s": 100.0, "elapsed_s": 3.0,
        "eta_s": None, "message": "done", "pid": 1, "updated": time.time()}))  # fmt: skip
    playbook = tmp_path / "poll.yml"
    playbook.write_text(
        "- name: Poll\n  hosts: localhost\n  gather_facts: false\n  tasks:\n"
        "    - name: Wait for the training\n      job_progress:\n        stage: training\n"
        f"        output_dir: {out}\n        wait_s: 0\n"
        "    - name: Name the outputs\n      ansible.builtin.set_stats:\n"
        f"        data: {{{PATHS_STATS_KEY}: {{report: /x/report/index.html}}}}\n        per_host: false\n"
    )
    runner = run_project_playbook(tmp_path, playbook, INVENTORY, {})
    events = list(runner.events)

    progress = [simple for event in events if (simple := simplify_event(event)) and simple["kind"] == "progress"]

    assert len(progress) == 1
    assert progress[0]["host"] == HOST
    assert progress[0]["task"] == "Wait for the training"
    assert progress[0]["message"].startswith("step 5/5 (epoch 1), loss 2.50")
    assert produced_paths(events) == {"report": "/x/report/index.html", "training_dir": str(out)}


def test_the_display_redraws_progress_in_place_on_a_terminal_only():
    import io

    events = [
        {"kind": "play", "play": "Train"},
        {"kind": "task", "task": "Wait", "role": "eagle_training"},
        {"kind": "progress", "host": HOST, "message": "step 1/2"},
        {"kind": "progress", "host": HOST, "message": "step 2/2"},
        {"kind": "ok", "host": HOST, "task": "Wait", "role": "eagle_training", "message": None},
        {"kind": "skipped", "host": HOST, "task": "Other", "role": "", "message": None},
    ]
    plain, tty = io.StringIO(), io.StringIO()
    for stream, is_tty in ((plain, False), (tty, True)):
        display = ProgressDisplay(stream, tty=is_tty)
        for event in events:
            display(event)

    assert plain.getvalue().splitlines() == [
        "PLAY Train",
        f"  ...         {HOST} | step 1/2",
        f"  ...         {HOST} | step 2/2",
        f"  ok          {HOST} | eagle_training : Wait",
    ]
    screen = re.sub(r"\x1b\[[0-9;]*m", "", tty.getvalue())
    assert f"\r\x1b[K  ...         {HOST} | step 2/2\n  ok " in screen


def test_the_documented_example_runs(monkeypatch, capsys):
    doc = (ROOT / "docs" / "python-api.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.DOTALL)
    assert len(blocks) == 2
    monkeypatch.chdir(ROOT)

    for block in blocks:
        exec(compile(block, "docs/python-api.md", "exec"), {"__name__": "docs_example"})  # noqa: S102

    printed = capsys.readouterr().out
    assert f"gpu_reset on {HOST} (check mode: nothing signalled)" in printed
    assert "successful HostStats(ok=" in printed
    assert "Validating arguments against arg spec" in printed and f" {HOST} 2\n" in printed
