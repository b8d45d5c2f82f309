"""The eagle3-pipeline console script, run as a real subprocess the way an operator runs it."""

from __future__ import annotations

import os
import subprocess
import sysconfig
from pathlib import Path

import pytest

from eagle3_pipeline import __version__

SCRIPTS = Path(sysconfig.get_path("scripts"))
CLI = SCRIPTS / "eagle3-pipeline"


def unactivated_env() -> dict[str, str]:
    """This environment as a shell that has not activated the venv has it: no venv on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "ANSIBLE_CONFIG")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p) != SCRIPTS)
    return env


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run the console script by its path, from cwd, with output captured (so not a terminal)."""
    return subprocess.run(
        [str(CLI), *args], cwd=cwd, env=unactivated_env(), capture_output=True, text=True, timeout=120, check=False
    )


def test_gpu_reset_check_prints_what_it_would_stop_without_the_venv_on_path(tmp_path, device_file, start_holder):
    holder = start_holder("cli-checked", device_file)

    proc = run_cli("gpu-reset", "--check", "-e", f'gpu_reset_device_paths=["{device_file}"]', cwd=tmp_path)

    output = proc.stdout.replace("\r", "")
    assert proc.returncode == 0, output + proc.stderr
    assert f"would stop PID {holder.pid} (" in output
    assert "\x1b[" not in output, "colour codes in output that goes to a pipe"
    assert holder.alive()
    assert not holder.got_sigterm()


def test_version(tmp_path):
    proc = run_cli("--version", cwd=tmp_path)

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"eagle3-pipeline {__version__}"


def test_a_missing_inventory_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-inventory.yml"

    proc = run_cli("gpu-reset", "--check", "-i", str(missing), cwd=tmp_path)

    assert proc.returncode == 2
    assert f"inventory {missing} does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "PLAY" not in proc.stdout


@pytest.mark.parametrize(
    ("extra_var", "expected"),
    [
        ("gpu_reset_grace_s", "-e expects KEY=VALUE, got 'gpu_reset_grace_s'"),
        ("=5", "-e expects KEY=VALUE, got '=5'"),
        ('gpu_reset_device_paths=["/dev/nvidia0"', "-e gpu_reset_device_paths: '[\"/dev/nvidia0\"' looks like a JSON"),
    ],
)
def test_a_malformed_extra_var_is_a_clear_error(tmp_path, extra_var, expected):
    proc = run_cli("gpu-reset", "--check", "-e", extra_var, cwd=tmp_path)

    assert proc.returncode == 1
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "PLAY" not in proc.stdout
