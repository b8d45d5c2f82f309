"""playbooks/site.yml when the extraction fails: the play fails naming the cause, the capture
server it started is stopped anyway (block/always), and nothing after the extraction runs.

The whole pipeline's success path (check on fresh hosts, converge, idempotence, verify) is the
Molecule ``remote`` scenario, over SSH on two booted hosts; these tests cover the failure paths
on localhost, through ansible-runner as the Python API runs it.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import yaml
from runner_runs import ROOT, run_project_playbook

from eagle3_pipeline.models.tiny import build_tiny_model
from eagle3_pipeline.serve.supervisor import Service

PLAYBOOK = ROOT / "playbooks" / "site.yml"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def local_inventory(tmp_path: Path, dataset: Path, **extra) -> Path:
    """One localhost host running the tiny model's pipeline on this machine, under ``tmp_path/work``."""
    model = build_tiny_model(ROOT / ".cache" / "models" / "tiny-llama")
    work = tmp_path / "work"
    python = sys.executable
    variables = {
        "ansible_connection": "local", "ansible_python_interpreter": python, "gpu_reset_required": False,
        "sglang_server_engine": "reference", "sglang_server_model_path": str(model),
        "sglang_server_aux_layers": [0, 1, 2], "sglang_server_venv": str(Path(python).parent.parent),
        "sglang_server_install": False, "sglang_server_supervisor": "process",
        "sglang_server_state_dir": str(work / "servers"), "sglang_server_capture_dir": str(work / "capture"),
        "sglang_server_port": free_port(), "sglang_server_device": "cpu",
        "sglang_server_gpu_reset_after_stop": False,
        "extraction_dataset": str(dataset), "extraction_output_dir": str(work / "data"),
        "extraction_state_dir": str(work / "jobs"), "extraction_poll_s": 1, "extraction_command_poll_s": 1,
        "extraction_timeout_s": 300, "evaluation_poll_s": 1,
        "eagle_training_output_dir": str(work / "training"), "eagle_training_state_dir": str(work / "jobs"),
        **extra,
    }
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {"gpu_hosts": {"hosts": {"localhost": variables}}}}}))
    return inventory


def task_starts(runner) -> list[dict]:
    """The event data of every task the run started, in order."""
    return [e["event_data"] for e in runner.events if e["event"] == "playbook_on_task_start"]


def test_a_failing_extraction_still_stops_the_server_and_stops_the_pipeline(tmp_path):
    dataset = tmp_path / "broken.jsonl"
    dataset.write_text("".join(f'{{"id": "bad-{i}", "conversations": "not a list"}}\n' for i in range(6)))
    (tmp_path / "broken.heldout.jsonl").write_text(dataset.read_text())
    inventory = local_inventory(tmp_path, dataset)
    work = tmp_path / "work"

    (tmp_path / "runner").mkdir()
    runner = run_project_playbook(tmp_path / "runner", PLAYBOOK, inventory, {})

    assert runner.status == "failed"
    failed = [e["event_data"] for e in runner.events if e["event"] == "runner_on_failed"
              and not e["event_data"].get("ignore_errors")]
    assert failed and all(e.get("role") == "extraction" for e in failed), [e.get("task") for e in failed]
    message = json.dumps([e["res"] for e in failed])
    assert "skip" in message.lower(), message  # the extraction says why: every record was skipped
    starts = task_starts(runner)
    failed_at = max(i for i, e in enumerate(starts) if e.get("task") == failed[-1].get("task"))
    after = [e.get("task", "") for e in starts[failed_at + 1:] if e.get("role") == "sglang_server"]
    assert any("Stop the server" in task for task in after), f"the always section did not stop the server: {after}"
    assert not any(e["event_data"].get("role") == "eagle_training" for e in runner.events
                   if e["event"] == "playbook_on_task_start"), "training ran after a failed extraction"
    states = list((work / "servers").glob("*.json"))
    assert states, "the server was never started"
    for state in states:  # the supervisor's own view: the process it recorded is gone
        assert Service(work / "servers", state.stem).status()["running"] is False


def test_missing_held_out_prompts_fail_the_run_at_its_start_not_after_the_training(tmp_path):
    # No evaluation_prompts: the default is <dataset>.heldout.jsonl beside the dataset, on the host.
    dataset = tmp_path / "conversations.jsonl"
    turns = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]
    dataset.write_text(json.dumps({"id": "a", "conversations": turns}) + "\n")
    inventory = local_inventory(tmp_path, dataset)

    (tmp_path / "runner").mkdir()
    runner = run_project_playbook(tmp_path / "runner", PLAYBOOK, inventory, {})

    assert runner.status == "failed"
    failed = [e["event_data"] for e in runner.events if e["event"] == "runner_on_failed"]
    message = json.dumps([e["res"].get("msg") for e in failed])
    assert f"{tmp_path / 'conversations.heldout.jsonl'}" in message and "evaluation_prompts" in message, message
    ran = {(e.get("role"), e.get("task")) for e in task_starts(runner)}
    assert not any(role in ("sglang_server", "extraction", "eagle_training") for role, _ in ran), sorted(ran)
