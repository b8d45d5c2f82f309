"""Every path a role must be given is refused at its preflight when it is left empty, by its name.

Ansible renders a variable left at its empty default (or set from an environment variable that was not
exported) as '', and a command given '' as a path acts on its working directory: the sglang_server role
once ran ``tiny-model --output ''`` on a fresh host and advised removing the operator's home directory.
Each role is run through ansible-runner on one localhost host per variable, every other path valid:
each host fails at the role's first check, naming its variable, before any command runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from runner_runs import run_project_playbook

from eagle3_pipeline.cli import main as cli_main

CHECK_TASK = "Fail when a path that must be set is empty"

# role: the path variables it must be given (each is blanked on a host of its own).
REQUIRED_PATHS = {
    "eagle3": ["eagle3_venv"],
    "sglang_server": ["sglang_server_model_path", "sglang_server_venv", "sglang_server_state_dir"],
    "regeneration": ["regeneration_dataset", "regeneration_output_dir", "regeneration_state_dir",
                     "regeneration_venv", "sglang_server_model_path"],
    "extraction": ["extraction_dataset", "extraction_output_dir", "extraction_state_dir"],
    "eagle_training": ["eagle_training_data_dir", "eagle_training_output_dir", "eagle_training_state_dir"],
    "evaluation": ["evaluation_drafter_dir", "evaluation_output_dir", "evaluation_prompts", "evaluation_state_dir"],
    "report": ["report_output_dir", "report_venv"],
}


def valid_paths(work: Path) -> dict:
    """Every path variable of every role, set to a directory under ``work`` (none of them exists)."""
    venv = str(Path(sys.executable).parent.parent)
    names = {name for names in REQUIRED_PATHS.values() for name in names}
    paths = {name: str(work / name) for name in names}
    return {**paths, "eagle3_venv": venv, "sglang_server_venv": venv, "regeneration_venv": venv,
            "report_venv": venv, "eagle3_install": False, "sglang_server_install": False,
            "sglang_server_build_tiny_model": True, "sglang_server_engine": "reference"}


def run_role(tmp_path: Path, role: str, hosts: dict) -> dict:
    """Run ``role`` on these localhost hosts ({name: variables}); each host's failed event by host name."""
    playbook = tmp_path / f"{role}.yml"
    playbook.write_text(yaml.safe_dump([{
        "name": f"Run {role}", "hosts": "all", "gather_facts": False,
        "tasks": [{"name": f"Run the role {role}", "ansible.builtin.include_role": {"name": role}}],
    }], sort_keys=False))
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    inventory = tmp_path / f"{role}-hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": {name: {**local, **v} for name, v in hosts.items()}}}))
    private = tmp_path / f"runner-{role}-{len(list(tmp_path.glob('runner-*')))}"
    private.mkdir()
    runner = run_project_playbook(private, playbook, inventory, {})
    return {e["event_data"]["host"]: e["event_data"] for e in runner.events if e["event"] == "runner_on_failed"}


@pytest.mark.parametrize("role", list(REQUIRED_PATHS))
def test_each_required_path_left_empty_fails_the_preflight_naming_it(tmp_path, role):
    work = tmp_path / "work"
    base = valid_paths(work)
    # The report checks once per play (run_once): one host per run there, several elsewhere.
    batches = [[name] for name in REQUIRED_PATHS[role]] if role == "report" else [REQUIRED_PATHS[role]]
    for batch in batches:
        hosts = {f"blank-{name}": {**base, name: value}
                 for name, value in zip(batch, ["", "  ", *[""] * len(batch)])}
        failed = run_role(tmp_path, role, hosts)
        assert set(failed) == set(hosts), f"{role}: hosts that did not fail: {set(hosts) - set(failed)}"
        for name in batch:
            event = failed[f"blank-{name}"]
            message = event["res"]["msg"]
            assert event["task"] == CHECK_TASK, (name, event["task"], message)
            assert message.startswith(f"blank-{name}: {name} must be set"), message
            others = [other for other in REQUIRED_PATHS[role] if other != name]
            assert not any(message.startswith(f"blank-{name}: {name}, {other}") for other in others), message
    assert not work.exists(), f"{role}: something was written under {work}: {sorted(work.rglob('*'))}"


@pytest.mark.parametrize("command", [
    ["tiny-model", "--output", ""],
    ["demo-dataset", "--output", ""],
    ["import-gguf", "--gguf", "model.gguf", "--output", " "],
    ["extract", "--dataset", "", "--output-dir", "out", "--server-url", "http://127.0.0.1:1"],
    ["regenerate", "--dataset", "d.jsonl", "--output-dir", "out", "--server-url", "http://127.0.0.1:1",
     "--model-path", ""],
    ["train", "--data-dir", "", "--output-dir", "out"],
    ["evaluate", "--drafter-dir", "d", "--prompts", "", "--output-dir", "out"],
    ["report", "--output-dir", ""],
    ["wheelhouse", ""],
])
def test_no_command_takes_an_empty_path(tmp_path, monkeypatch, capsys, command):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        cli_main(command)
    assert exited.value.code == 2
    assert "an empty path" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing written where it was started
