"""playbooks/regenerate.yml through ansible-runner on localhost: the tiny model, the reference engine.

The role builds the demo conversations, starts a serving server of its own (no capture), runs
the regeneration under the supervisor while printing its progress, stops the server again and
merges. ``sglang_server_install`` is false, as in the other playbook tests: the server runs from
this checkout's venv. Check mode first (nothing started or written), then a run, then a rerun
that starts no server and changes nothing.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

from runner_runs import run_project_playbook
from tiny_target import built_tiny_model

from eagle3_pipeline.serve.supervisor import Service

ROOT = Path(__file__).resolve().parents[2]
PLAYBOOK = ROOT / "playbooks" / "regenerate.yml"
INVENTORY = ROOT / "inventory" / "local.yml"
NUM_SAMPLES = 12


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Run:
    """One ansible-runner run of the playbook: status, stats, events, stdout."""

    def __init__(self, runner):
        self.status = runner.status
        self.stats = runner.stats or {}
        self.events = list(runner.events)
        self.stdout = runner.stdout.read()

    def changed(self) -> int:
        return self.stats.get("changed", {}).get("localhost", 0)

    def changed_tasks(self) -> list[str]:
        return [e["event_data"]["task"] for e in self.events
                if e.get("event") == "runner_on_ok" and e["event_data"]["res"].get("changed")]

    def ran(self, task: str) -> bool:
        return any(e["event_data"].get("task") == task for e in self.events
                   if e.get("event") in ("runner_on_ok", "runner_on_failed"))

    def summary(self) -> str:
        shown = [e["event_data"]["res"]["msg"] for e in self.events
                 if e.get("event") == "runner_on_ok" and e["event_data"]["task"] == "Show the regeneration"]
        assert len(shown) == 1, self.stdout
        return "\n".join(shown[0])


def snapshot(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_mtime_ns for p in sorted(directory.rglob("*")) if p.is_file()}


def test_check_then_a_run_with_its_own_serving_server_then_a_rerun_that_starts_nothing(tmp_path, tmp_path_factory):
    model = built_tiny_model()
    out, servers = tmp_path / "regenerated", tmp_path / "servers"
    extravars = {
        "sglang_server_model_path": str(model), "sglang_server_state_dir": str(servers),
        "sglang_server_capture_dir": str(tmp_path / "capture"), "sglang_server_gpu_reset_after_stop": False,
        "regeneration_dataset": str(tmp_path / "dataset" / "train.jsonl"), "regeneration_build_demo_dataset": True,
        "regeneration_output_dir": str(out), "regeneration_state_dir": str(tmp_path / "jobs"),
        "regeneration_num_samples": NUM_SAMPLES, "regeneration_max_new_tokens": 24,
        "regeneration_server_port": free_port(), "regeneration_poll_s": 1, "regeneration_command_poll_s": 1,
        "regeneration_timeout_s": 600,
    }

    def run(check: bool = False) -> Run:
        return Run(run_project_playbook(tmp_path_factory.mktemp("runner"), PLAYBOOK, INVENTORY, extravars, check))

    checked = run(check=True)

    assert checked.status == "successful", checked.stdout
    assert "localhost: part 0/1: would build the demo dataset" in checked.summary()
    assert not (tmp_path / "dataset").exists() and not out.exists() and not (tmp_path / "jobs").exists()

    first = run()

    assert first.status == "successful", first.stdout
    assert f"[localhost] part 0/1: {NUM_SAMPLES}/{NUM_SAMPLES} conversations, 0 skipped, 0 failed" in first.stdout
    lines = (out / "regenerated.jsonl").read_text().splitlines()
    assert len(lines) == NUM_SAMPLES and all(set(json.loads(line)) == {"id", "messages"} for line in lines)
    summary = json.loads((out / "regeneration.json").read_text())
    assert summary["num_conversations"] == NUM_SAMPLES and summary["settings"]["max_new_tokens"] == 24
    assert f"{NUM_SAMPLES} of {NUM_SAMPLES} conversations regenerated: {summary['turns']} assistant turns" in \
        first.summary()
    states = list(servers.glob("*.json"))
    assert [s.stem for s in states] == [f"eagle3-reference-{extravars['regeneration_server_port']}"]
    assert Service(servers, states[0].stem).status()["running"] is False  # stopped again (always)
    log = (servers / f"{states[0].stem}.log").read_text()
    assert "capture_dir=None" in log and "max_batch_size=64" in log  # a serving server, batching large
    before = snapshot(tmp_path / "dataset") | snapshot(out)

    second = run()

    assert second.status == "successful", second.stdout
    assert second.changed() == 0, second.changed_tasks()
    assert not second.ran("Start the serving server (no capture; radix cache and CUDA graphs on)")
    assert "localhost: part 0/1: already complete (12 conversations), no server started" in second.summary()
    assert snapshot(tmp_path / "dataset") | snapshot(out) == before
    done = subprocess.run([sys.executable, "-m", "eagle3_pipeline.cli", "progress", str(out)], capture_output=True,
                          text=True, check=False)
    assert f"{NUM_SAMPLES}/{NUM_SAMPLES} conversations" in done.stdout, done.stderr


def test_a_mixture_of_sources_in_the_inventory_is_regenerated_with_each_sources_share(tmp_path, tmp_path_factory):
    """regeneration_dataset as a list of sources, as an inventory names ShareGPT and a second dataset."""
    from eagle3_pipeline.data.demo_dataset import write_demo_dataset

    model = built_tiny_model()
    first, second = tmp_path / "sharegpt.jsonl", tmp_path / "traffic.jsonl"
    write_demo_dataset(first, num_samples=4)
    write_demo_dataset(second, num_samples=3)
    out = tmp_path / "regenerated"
    extravars = {
        "sglang_server_model_path": str(model), "sglang_server_state_dir": str(tmp_path / "servers"),
        "sglang_server_capture_dir": str(tmp_path / "capture"), "sglang_server_gpu_reset_after_stop": False,
        "regeneration_dataset": [{"path": str(first), "count": 3}, {"path": str(tmp_path / "gone.parquet")}],
        "regeneration_output_dir": str(out), "regeneration_state_dir": str(tmp_path / "jobs"),
        "regeneration_max_new_tokens": 8, "regeneration_server_port": free_port(), "regeneration_poll_s": 1,
        "regeneration_command_poll_s": 1, "regeneration_timeout_s": 600,
    }

    missing = Run(run_project_playbook(tmp_path_factory.mktemp("runner"), PLAYBOOK, INVENTORY, extravars))

    assert missing.status == "failed"
    assert f"the dataset {tmp_path / 'gone.parquet'} does not exist on this host" in missing.stdout
    assert not out.exists()

    extravars["regeneration_dataset"][1] = {"path": str(second), "name": "ours"}
    # And the serving server as two replicas behind its one address (one per GPU on a GPU host; two CPU
    # processes here), its dp_size checked live by the role like every other setting.
    done = Run(run_project_playbook(tmp_path_factory.mktemp("runner"), PLAYBOOK, INVENTORY,
                                    {**extravars, "sglang_server_dp_size": 2}))

    assert done.status == "successful", done.stdout
    ids = [json.loads(line)["id"] for line in (out / "regenerated.jsonl").read_text().splitlines()]
    assert [i.split(".")[0] for i in ids] == ["sharegpt"] * 3 + ["ours"] * 3
    assert json.loads((out / "regeneration.json").read_text())["sources"] == {"ours": 3, "sharegpt": 3}
    log = next((tmp_path / "servers").glob("*.log")).read_text()
    assert "dp_size=2 replicas: replica 0" in log and "[replica 1/2]" in log
    answered = [int(n) for n in re.findall(r"replica \d \(pid \d+, [^)]*\) answered (\d+) request", log)]
    assert len(answered) == 2 and min(answered) >= 1, log  # both replicas regenerated
