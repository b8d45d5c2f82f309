"""playbooks/site.yml on localhost, through ansible-runner as the Python API runs it: the failure
paths (a failing extraction: the play fails naming the cause, the capture server it started is
stopped anyway by block/always, and nothing after the extraction runs; missing held-out prompts fail
the run at its start), and the local path itself: site.yml on inventory/local.yml, what `make demo`
runs (connection local, the process supervisor, the regeneration, no fetch), at small sizes, through
to the report, then a rerun that changes nothing.

The remote path (check on fresh hosts, converge, idempotence, verify over SSH on two hosts booted
with systemd) is the Molecule ``remote`` scenario.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import yaml
from runner_runs import ROOT, run_project_playbook
from tiny_target import built_tiny_model

from eagle3_pipeline.serve.supervisor import Service

PLAYBOOK = ROOT / "playbooks" / "site.yml"
DEMO_INVENTORY = ROOT / "inventory" / "local.yml"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def local_inventory(tmp_path: Path, dataset: Path, **extra) -> Path:
    """One localhost host running the tiny model's pipeline on this machine, under ``tmp_path/work``."""
    model = built_tiny_model()
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


def demo_inventories(tmp_path: Path) -> list[str]:
    """inventory/local.yml, and beside it this host's variables for a run at small sizes: every path under
    ``tmp_path/demo``, free ports, 16 conversations.

    Host variables, not extra vars: they override the inventory's group variables as an operator's
    would, and leave what the playbook and the roles set (the regeneration's serving port, the
    regenerated dataset for the extraction) to them; extra vars would win over those too.
    """
    demo = tmp_path / "demo"
    variables = {
        # The inventory's model is the default seed's; the tests' seed has its own build (built once, shared).
        "sglang_server_model_path": str(built_tiny_model()),
        "gpu_reset_report_dir": str(demo / "gpu_reset"),
        "sglang_server_state_dir": str(demo / "servers"), "sglang_server_capture_dir": str(demo / "capture"),
        "sglang_server_port": free_port(), "regeneration_server_port": free_port(),
        "regeneration_output_dir": str(demo / "regenerated"), "regeneration_max_new_tokens": 24,
        "regeneration_poll_s": 1, "regeneration_command_poll_s": 1,
        "extraction_dataset": str(demo / "dataset" / "train.jsonl"), "extraction_output_dir": str(demo / "data"),
        "extraction_state_dir": str(demo / "jobs"), "extraction_num_samples": 16, "extraction_poll_s": 1,
        "extraction_command_poll_s": 1,
        "eagle_training_output_dir": str(demo / "training"), "eagle_training_drafter_dir": str(demo / "drafter"),
        "eagle_training_state_dir": str(demo / "jobs"), "eagle_training_draft_vocab_size": 512,
        "eagle_training_ttt_length": 3, "eagle_training_epochs": 1, "eagle_training_batch_tokens": 256,
        "eagle_training_eval_ratio": 0.2, "eagle_training_master_port": free_port(),
        "eagle_training_poll_interval": 1,
        "evaluation_drafter_dir": str(demo / "drafter"), "evaluation_output_dir": str(demo / "evaluation"),
        "evaluation_num_prompts": 4, "evaluation_max_new_tokens": 16, "evaluation_draft_tokens": [3],
        "evaluation_poll_s": 1,
    }
    overlay = tmp_path / "small.yml"
    overlay.write_text(yaml.safe_dump({"all": {"hosts": {"localhost": variables}}}))
    return [str(DEMO_INVENTORY), str(overlay)]


def task_starts(runner) -> list[dict]:
    """The event data of every task the run started, in order."""
    return [e["event_data"] for e in runner.events if e["event"] == "playbook_on_task_start"]


def changed_tasks(runner) -> list[str]:
    """What a run changed, as its output says it ("changed: [host]" under each task's header) and as its
    events say it (any event whose result reports a change, loop items included)."""
    said, task = [], None
    for line in runner.stdout.read().splitlines():
        if line.startswith("TASK ["):
            task = line.rstrip(" *")
        elif line.startswith("changed: "):
            said.append(f"{task}: {line}")
    for event in runner.events:
        res = event.get("event_data", {}).get("res")
        if isinstance(res, dict) and (res.get("changed") or any(
                isinstance(item, dict) and item.get("changed") for item in res.get("results") or [])):
            said.append(f"event {event['event']}: {event['event_data'].get('role')}: {event['event_data'].get('task')}")
    return said


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


def test_on_a_fresh_checkout_the_model_is_built_before_the_regeneration_reads_it_and_check_mode_says_so(tmp_path):
    # As on a fresh clone: the inventory's model directory does not exist yet (sglang_server_build_tiny_model: true
    # in inventory/local.yml), and the regeneration, which reads the target's tokenizer, is on.
    model = tmp_path / "models" / "tiny-llama"
    fresh = tmp_path / "fresh.yml"
    fresh.write_text(yaml.safe_dump({"all": {"hosts": {"localhost": {
        "sglang_server_model_path": str(model), "regeneration_num_samples": 2}}}}))
    inventories = [*demo_inventories(tmp_path), str(fresh)]

    (tmp_path / "check").mkdir()
    check = run_project_playbook(tmp_path / "check", PLAYBOOK, inventories, {}, check=True)

    output = check.stdout.read()
    assert check.status == "successful", output
    assert f"the embedded tiny model would be built at {model}" in output, output
    assert "would regenerate" in output and "once the target model" in output, output
    assert not model.exists()

    (tmp_path / "run").mkdir()
    run = run_project_playbook(tmp_path / "run", PLAYBOOK, inventories, {}, tags="regenerate")

    assert run.status == "successful", run.stdout.read()
    assert (model / "config.json").is_file()
    tasks = [(e.get("role"), e.get("task")) for e in task_starts(run)]
    built = tasks.index(("sglang_server", "Build the embedded tiny model"))
    read = tasks.index(("regeneration", "Ask the regeneration what is done and what is left (it asks no server)"))
    assert built < read, tasks
    regenerated = json.loads((tmp_path / "demo" / "regenerated" / "regeneration.json").read_text())
    assert regenerated["num_conversations"] == 2 and regenerated["generated_tokens"] > 0


def test_the_demo_fails_at_its_start_without_held_out_prompts_then_runs_through_and_a_rerun_changes_nothing(
    tmp_path,
):
    # The demo's inventory with no dataset builder: nothing writes <dataset>.heldout.jsonl, the default
    # evaluation_prompts on the host, and the run must say so before any server starts.
    inventories = demo_inventories(tmp_path)
    heldout = tmp_path / "demo" / "dataset" / "train.heldout.jsonl"

    (tmp_path / "missing").mkdir()
    runner = run_project_playbook(tmp_path / "missing", PLAYBOOK, inventories, {"extraction_build_demo_dataset": False})

    assert runner.status == "failed"
    failed = [e["event_data"] for e in runner.events if e["event"] == "runner_on_failed"]
    message = json.dumps([e["res"].get("msg") for e in failed])
    assert f"{heldout}" in message and "evaluation_prompts" in message, message
    ran = {(e.get("role"), e.get("task")) for e in task_starts(runner)}
    stages = ("sglang_server", "regeneration", "extraction", "eagle_training")
    assert not any(role in stages for role, _ in ran), sorted(ran)

    # As `make demo` runs it (the builder writes the conversations and their held-out prompts): every stage
    # from the regeneration to the report, on this machine under the process supervisor. The capture port and
    # the dataset given as extra vars, as an operator may (-e): they outrank every variable the playbook and
    # the roles set, yet the regeneration's server keeps its own port and the extraction reads the regenerated
    # conversations.
    host = yaml.safe_load(Path(inventories[1]).read_text())["all"]["hosts"]["localhost"]
    extra = {"sglang_server_port": host["sglang_server_port"], "extraction_dataset": host["extraction_dataset"]}
    (tmp_path / "first").mkdir()
    first = run_project_playbook(tmp_path / "first", PLAYBOOK, inventories, extra)

    assert first.status == "successful", first.stdout.read()
    work = tmp_path / "demo"
    regenerated = json.loads((work / "regenerated" / "regeneration.json").read_text())
    data = json.loads((work / "data" / "data_config.json").read_text())
    training = json.loads((work / "training" / "training.json").read_text())
    evaluation = json.loads((work / "evaluation" / "evaluation.json").read_text())
    assert regenerated["num_conversations"] == 16 and regenerated["generated_tokens"] > 0
    # The extraction read the regenerated conversations (site.yml points it there), and each server had its port.
    assert data["num_samples"] == 16 and data["failed"] == []
    assert data["dataset"]["name"] == "regenerated.jsonl", data["dataset"]
    assert {state.stem for state in (work / "servers").glob("*.json")} == {
        f"eagle3-reference-{host['regeneration_server_port']}", f"eagle3-reference-{host['sglang_server_port']}"}
    assert training["steps"] > 0 and evaluation["prompts"] == 4 and evaluation["verdict"]["passed"]
    assert "acceptance" in (work / "report" / "index.html").read_text().lower()
    roles = {e.get("role") for e in task_starts(first)}
    assert {"regeneration", "sglang_server", "extraction", "eagle_training", "evaluation", "report"} <= roles
    for state in (work / "servers").glob("*.json"):  # both servers (serving, capture) were stopped
        assert Service(work / "servers", state.stem).status()["running"] is False
    assert not any(e.get("task") == "Fetch them to the controller" for e in task_starts(first)), "a local run fetches"

    (tmp_path / "again").mkdir()
    again = run_project_playbook(tmp_path / "again", PLAYBOOK, inventories, extra)

    assert again.status == "successful", again.stdout.read()
    assert again.stats["changed"].get("localhost", 0) == 0, changed_tasks(again)
    assert not [e for e in again.events if e["event"] == "runner_on_ok"
                and e["event_data"]["task"] == "Start the server (a changed configuration restarts it)"], (
        "the rerun started a server over finished data")
