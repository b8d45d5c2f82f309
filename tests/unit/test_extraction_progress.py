"""job_progress for an extraction part, its own parts: the part's progress line and counts, its file, its options.

What it shares with the training (finished / failed / stopped / dead told apart on real jobs,
the wait, the timeout) is tested for every stage in test_job_progress.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import job_progress as module
import pytest
from ansible.module_utils.extraction_progress import PartStage, ProgressError, format_duration, progress_line
from module_runs import run_module
from supervised_jobs import Jobs

RUNNING = {
    "state": "running", "part": "0/1", "pid": 1, "total": 1000, "done": 412, "skipped": 3, "failed": 0,
    "tokens": 81234, "tokens_per_s": 5210.4, "eta_s": 192.0, "started": 0.0, "updated": 0.0, "message": "",
}  # fmt: skip


def stage(output_dir, **params) -> PartStage:
    return PartStage({"output_dir": str(output_dir), "stage": "extraction", "part_index": 0, "part_count": 1,
                      **params})


@pytest.fixture
def jobs(tmp_path):
    started = Jobs(tmp_path, tmp_path / "data", tmp_path / "data" / "parts" / "part-0-of-1.progress.json",
                   {"stage": "extraction"})
    yield started
    started.stop_all()


def test_the_progress_line_reads_as_the_operator_needs_it():
    assert progress_line(RUNNING) == "412/1000 samples, 3 skipped, 0 failed, 5,210 tokens/s, about 0:03:12 left"
    assert progress_line({**RUNNING, "eta_s": None, "tokens_per_s": 0.0}) == (
        "412/1000 samples, 3 skipped, 0 failed, 0 tokens/s, time left not known yet"
    )
    done = {**RUNNING, "state": "done", "done": 997, "eta_s": 0.0}
    assert progress_line(done) == "997/1000 samples, 3 skipped, 0 failed, 81,234 tokens: done"
    failed = {**RUNNING, "state": "failed", "message": "disk full"}
    assert progress_line(failed) == "412/1000 samples, 3 skipped, 0 failed: failed: disk full"
    assert progress_line(None) == "waiting for the job's first progress report"
    assert format_duration(3 * 3600 + 62.4) == "3:01:02"


def test_a_running_part_returns_its_counts_under_names_ansible_does_not_read_as_status(jobs, capsys):
    jobs.start({k: v for k, v in RUNNING.items() if k != "pid"}, "sleep")

    code, result = run_module(module, jobs.args(), capsys)

    assert code == 0, result
    assert result["part"] == "0/1" and result["progress_file"] == str(jobs.progress_file)
    assert (result["samples_total"], result["samples_done"], result["samples_skipped"], result["samples_failed"]) == (
        1000, 412, 3, 0)
    assert (result["tokens"], result["turns"], result["tokens_per_s"], result["eta_s"]) == (81234, 0, 5210.4, 192.0)
    assert "skipped" not in result and "failed" not in result


def test_the_part_of_several_is_named_and_its_own_file_read(tmp_path, capsys):
    path = tmp_path / "parts" / "part-1-of-2.progress.json"
    path.parent.mkdir()
    path.write_text(json.dumps({**RUNNING, "state": "done", "part": "1/2"}))

    code, result = run_module(module, {"stage": "extraction", "output_dir": str(tmp_path), "part_index": 1,
                                       "part_count": 2, "wait_s": 0}, capsys)

    assert code == 0 and result["finished"] is True and result["part"] == "1/2"
    assert result["msg"] == "part 1/2: 412/1000 samples, 3 skipped, 0 failed, 81,234 tokens: done"


def test_without_a_supervisor_the_progress_pid_decides(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    part = stage(tmp_path)
    os.makedirs(os.path.dirname(part.progress_file))

    with open(part.progress_file, "w") as handle:
        json.dump({**RUNNING, "pid": gone.pid}, handle)
    assert part.read_status()[2] == "dead"
    with open(part.progress_file, "w") as handle:
        json.dump({**RUNNING, "pid": os.getpid()}, handle)
    assert part.read_status()[2] == "running"
    with open(part.progress_file, "w") as handle:
        json.dump({**RUNNING, "state": "done", "pid": gone.pid}, handle)
    assert part.read_status()[2] == "done"


def test_a_progress_file_that_is_not_json_is_named(tmp_path):
    part = stage(tmp_path)
    os.makedirs(os.path.dirname(part.progress_file))
    with open(part.progress_file, "w") as handle:
        handle.write("{not json")
    with pytest.raises(ProgressError, match="part-0-of-1.progress.json is not valid JSON"):
        part.read_status()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"part_index": 2, "part_count": 2}, "part_index must be in 0..1"),
        ({"part_count": 0}, "part_count must be >= 1"),
        ({"stage": "evaluation"}, "value of stage must be one of: extraction, regeneration, training"),
        ({"node_rank": 1}, "node_rank is not an option of stage extraction: it is one of training"),
    ],
)
def test_bad_part_options_fail_naming_the_option(tmp_path, capsys, args, message):
    code, result = run_module(module, {"stage": "extraction", "output_dir": str(tmp_path), **args}, capsys)

    assert code == 1 and message in result["msg"]
