"""The Ansible modules gpu_info, gpu_processes and gpu_wait_free, run in-process.

Module arguments go in through ansible-core's own test helper (patch_module_args); each
module's main() prints its JSON result and exits, which is captured and parsed. Processes are
real; NVML is the stand-in from fake_nvml, installed as sys.modules["pynvml"].

Every state=absent run names its own stand-in device file and a match pattern unique to the
test, so it can only ever select processes that the test started, even on a host with GPUs.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import gpu_info
import gpu_processes
import gpu_wait_free
import pytest
import yaml
from ansible.module_utils.gpu_nvml import driver_detected
from fake_nvml import FakeGpu, FakeNvml
from module_runs import run_module
from process_checks import running

RUN_REASON = "part of this run (an ancestor of the module: the Ansible run or what started it)"


@pytest.fixture
def no_pynvml(monkeypatch):
    """A host without the nvidia-ml-py package: ``import pynvml`` fails."""
    monkeypatch.setitem(sys.modules, "pynvml", None)


@pytest.fixture
def install_nvml(monkeypatch):
    """Install a FakeNvml as the pynvml module; returns the installer."""

    def install(gpus, **kwargs):
        fake = FakeNvml(gpus, **kwargs)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        return fake

    return install


@pytest.fixture
def tag(request):
    """A word unique to this test, put in its processes' command lines and its match patterns."""
    return "t%d-%s" % (os.getpid(), re.sub(r"\W", "", request.node.name)[:40])


@pytest.mark.parametrize("module", [gpu_info, gpu_processes, gpu_wait_free], ids=lambda m: m.__name__)
def test_every_module_documentation_is_valid_yaml(module):
    # A stray "word: " in a description once made ansible-doc refuse gpu_wait_free.
    documentation = yaml.safe_load(module.DOCUMENTATION)
    assert documentation["module"] == module.__name__
    assert isinstance(yaml.safe_load(module.RETURN), dict)
    assert isinstance(yaml.safe_load(module.EXAMPLES), list)


# -- gpu_info -------------------------------------------------------------------------------


def test_gpu_info_without_nvml_reports_it_unavailable(no_pynvml, capsys):
    rc, result = run_module(gpu_info, {}, capsys)
    assert rc == 0
    assert result["changed"] is False
    assert result["nvml_available"] is False
    assert "nvidia-ml-py (module pynvml) is not installed for %s" % sys.executable in result["reason"]
    assert result["driver_detected"] is driver_detected()
    assert result["python"] == sys.executable
    assert result["gpus"] == []
    assert result["health_problems"] == []


def test_gpu_info_without_nvml_fails_when_required(no_pynvml, capsys):
    rc, result = run_module(gpu_info, {"required": True}, capsys)
    assert rc == 1
    assert result["failed"] is True
    assert result["msg"].startswith("NVML is required but unavailable on this host: the Python package nvidia-ml-py")
    assert result["nvml_available"] is False


def test_gpu_info_reports_a_driver_that_does_not_load(install_nvml, capsys):
    install_nvml([FakeGpu()], init_error=FakeNvml.NVML_ERROR_DRIVER_NOT_LOADED)
    rc, result = run_module(gpu_info, {}, capsys)
    assert rc == 0
    assert result["nvml_available"] is False
    assert result["reason"] == "NVML could not be initialised: Driver Not Loaded (is the NVIDIA driver loaded?)"


def test_gpu_info_reports_gpus_processes_and_health(install_nvml, spawn, capsys):
    worker = spawn()
    fake = install_nvml(
        [
            FakeGpu(uuid="GPU-0", minor=0, used_mib=70000, compute=[(worker.pid, 70000)]),
            FakeGpu(uuid="GPU-1", minor=1, ecc_volatile_uncorrected=2, temperature_c=88, remapped=(0, 1, 1, 0)),
        ]
    )
    rc, result = run_module(gpu_info, {}, capsys)
    assert rc == 0
    assert result["changed"] is False
    assert result["nvml_available"] is True
    assert result["driver_version"] == "570.124.06"
    assert result["gpu_count"] == 2
    assert result["gpus"][0] == {
        "index": 0,
        "uuid": "GPU-0",
        "name": "NVIDIA H200",
        "minor_number": 0,
        "memory_total_mib": 143771,
        "memory_used_mib": 70000,
        "memory_reserved_mib": 615,
        "processes": [
            {"pid": worker.pid, "used_mib": 70000, "kind": "compute", "cmdline": " ".join(worker.popen.args)}
        ],
        "temperature_c": 31,
        "temperature_slowdown_c": 87,
        "ecc_volatile_uncorrected": 0,
        "remapped_rows_pending": False,
        "remapped_rows_failed": False,
        "remapped_rows_uncorrectable": 0,
        "persistence_mode": True,
    }
    problems = result["health_problems"]
    assert len(problems) == 3
    assert all(p.startswith("GPU 1 (GPU-1) ") for p in problems)
    assert "2 volatile uncorrected ECC error(s)" in problems[0]
    assert "row remapping pending" in problems[1]
    assert "at 88 C, at or above the limit of 87 C" in problems[2]
    assert fake.initialised == 0  # NVML was shut down


def test_gpu_info_honours_the_health_options_and_a_gpu_subset(install_nvml, capsys):
    install_nvml([FakeGpu(ecc_volatile_uncorrected=1), FakeGpu(uuid="GPU-1", temperature_c=80, remapped=(0, 0, 1, 0))])
    rc, result = run_module(
        gpu_info, {"gpus": [1], "max_temperature_c": 80, "check_ecc": False, "check_remapped_rows": False}, capsys
    )
    assert rc == 0
    assert [g["index"] for g in result["gpus"]] == [1]
    assert result["health_problems"] == [
        "GPU 1 (GPU-1) is at 80 C, at or above the limit of 80 C: check cooling before a long run"
    ]


def test_gpu_info_refuses_an_unknown_gpu_index(install_nvml, capsys):
    fake = install_nvml([FakeGpu(), FakeGpu()])
    rc, result = run_module(gpu_info, {"gpus": [0, 5]}, capsys)
    assert rc == 1
    assert result["msg"] == "gpus: GPU 5 does not exist on this host; it has 2 GPU(s) (indices 0-1)"
    assert result["gpu_count"] == 2
    assert fake.initialised == 0


def test_gpu_info_refuses_a_temperature_limit_below_one(install_nvml, capsys):
    install_nvml([FakeGpu()])
    rc, result = run_module(gpu_info, {"max_temperature_c": 0}, capsys)
    assert rc == 1
    assert result["msg"] == "max_temperature_c must be a positive number of degrees C, got 0"


def test_gpu_info_names_a_gpu_that_nvml_cannot_read(install_nvml, capsys):
    lost = FakeNvml.NVML_ERROR_GPU_IS_LOST
    fake = install_nvml([FakeGpu(), FakeGpu(errors={"nvmlDeviceGetMemoryInfo": lost})])
    rc, result = run_module(gpu_info, {}, capsys)
    assert rc == 1
    assert result["msg"].startswith("GPU 1: NVML query failed: GPU is lost; ")
    assert "nvidia-smi -r" in result["msg"]
    assert fake.initialised == 0


def test_gpu_info_in_check_mode_reads_the_same(install_nvml, capsys):
    install_nvml([FakeGpu(used_mib=3)])
    rc, result = run_module(gpu_info, {}, capsys, check_mode=True)
    assert rc == 0
    assert result["changed"] is False
    assert result["gpus"][0]["memory_used_mib"] == 3


# -- gpu_processes --------------------------------------------------------------------------


def absent(device_file, tag, **extra):
    args = {"state": "absent", "device_paths": [device_file], "match": [tag], "use_nvml": "never", "grace_s": 5}
    args.update(extra)
    return args


def test_gpu_processes_stops_a_real_holder(spawn, device_file, tag, capsys):
    holder = spawn("--hold", device_file, "--tag", tag)
    # A grace no healthy stop comes near (a signal handled: milliseconds), so that ending within it shows
    # the holder's exit was seen at once rather than waited out.
    grace_s = 30
    rc, result = run_module(gpu_processes, absent(device_file, tag, grace_s=grace_s), capsys)
    assert rc == 0, result.get("msg")
    assert result["changed"] is True
    assert not running(holder.key)
    assert [h["pid"] for h in result["holders"]] == [holder.pid]
    assert result["holders"][0]["devices"] == [device_file]
    assert result["units"] == [{"kind": "process", "id": holder.pid, "pids": [holder.pid]}]
    (record,) = result["stopped"]
    assert record["pid"] == holder.pid
    assert record["signal"] == "SIGTERM"
    assert record["holder"] is True
    assert record["seconds"] < grace_s
    assert isinstance(result["first_signal_at"], float)
    assert result["device_paths"] == [device_file]
    assert result["nvml_available"] is False


def test_gpu_processes_stops_a_holder_and_its_group(spawn, device_file, tag, capsys):
    holder = spawn("--hold", device_file, "--tag", tag, "--children", 2, "--child-ignore-term", new_session=True)
    # Long enough for the holder to end by SIGTERM on a loaded machine; the children ignore it and
    # hold the stop for the whole grace.
    args = absent(device_file, tag, match=[], grace_s=3)
    rc, result = run_module(gpu_processes, args, capsys)
    assert rc == 0, result.get("msg")
    assert result["units"] == [{"kind": "group", "id": holder.pid, "pids": sorted([holder.pid, *holder.child_pids])}]
    assert not running(holder.key)
    assert not any(running(key) for key in holder.children)
    signals = {r["pid"]: (r["signal"], r["holder"]) for r in result["stopped"]}
    assert signals == {holder.pid: ("SIGTERM", True), **{pid: ("SIGKILL", False) for pid in holder.child_pids}}


def test_gpu_processes_in_check_mode_signals_nothing(spawn, device_file, tag, tmp_path, capsys):
    marker = tmp_path / "term"
    holder = spawn("--hold", device_file, "--tag", tag, "--term-marker", marker)
    rc, result = run_module(gpu_processes, absent(device_file, tag), capsys, check_mode=True)
    assert rc == 0
    assert result["changed"] is True
    assert result["would_stop"] == [
        {
            "pid": holder.pid,
            "pgid": holder.info.pgid,
            "cmdline": " ".join(holder.popen.args),
            "unit": "process %d" % holder.pid,
            "gpus": [],
            "holder": True,
        }
    ]
    assert result["stopped"] == []
    assert result["first_signal_at"] is None
    assert running(holder.key)
    assert not marker.exists()


def test_gpu_processes_with_nothing_holding_the_file_changes_nothing(device_file, tag, capsys):
    rc, result = run_module(gpu_processes, absent(device_file, tag), capsys)
    assert rc == 0
    assert result["changed"] is False
    assert (result["holders"], result["units"], result["stopped"], result["left"]) == ([], [], [], [])


def test_gpu_processes_state_present_only_reports(spawn, device_file, tag, capsys):
    holder = spawn("--hold", device_file, "--tag", tag)
    rc, result = run_module(gpu_processes, absent(device_file, tag, state="present"), capsys)
    assert rc == 0
    assert result["changed"] is False
    assert [h["pid"] for h in result["holders"]] == [holder.pid]
    assert result["units"] == [{"kind": "process", "id": holder.pid, "pids": [holder.pid]}]
    assert result["stopped"] == []
    assert running(holder.key)


def test_gpu_processes_leaves_a_protected_holder(spawn, device_file, tag, capsys):
    kept = spawn("--hold", device_file, "--tag", tag + "-dcgm")
    rc, result = run_module(gpu_processes, absent(device_file, tag, protect=["dcgm"]), capsys)
    assert rc == 0
    assert result["changed"] is False
    assert [(r["pid"], r["reason"]) for r in result["left"]] == [
        (kept.pid, "protected: matches 'dcgm' (gpu_reset_protect or gpu_reset_protect_extra)")
    ]
    assert running(kept.key)


def test_gpu_processes_stops_a_holder_nvml_lists(install_nvml, spawn, tmp_path, tag, capsys):
    worker = spawn("--tag", tag)  # holds no file: only NVML knows it uses the GPU
    fake = install_nvml([FakeGpu(compute=[(worker.pid, 1000)]), FakeGpu()])
    unheld = tmp_path / "nvidia-unheld"
    unheld.write_bytes(b"")
    args = {"state": "absent", "device_paths": [str(unheld)], "match": [tag], "use_nvml": "always", "grace_s": 5}
    rc, result = run_module(gpu_processes, args, capsys)
    assert rc == 0, result.get("msg")
    assert result["nvml_available"] is True
    assert result["holders"][0]["gpus"] == [0]
    assert result["holders"][0]["used_mib"] == 1000
    (record,) = result["stopped"]
    assert (record["pid"], record["gpus"], record["signal"]) == (worker.pid, [0], "SIGTERM")
    assert not running(worker.key)
    assert fake.initialised == 0


def test_gpu_reset_over_four_gpus_stops_each_selectable_holder_and_verifies_every_gpu(install_nvml, spawn, tmp_path,
                                                                                      tag, capsys):
    # A host's GPUs held at once, as the seeds' 8-GPU host is after a run: the same rules on every GPU.
    polite = spawn("--tag", tag)  # GPU 0: leaves on SIGTERM
    tp_server = spawn("--tag", tag, new_session=True)  # GPUs 0 and 3: one process over two GPUs, its own group
    stubborn = spawn("--tag", tag, "--ignore-term")  # GPU 1: needs SIGKILL after the grace
    kept = spawn("--tag", tag + "-persistenced")  # GPU 2: protected
    stranger = spawn("--tag", "unrelated%d" % os.getpid())  # GPU 3: not selected by the match
    install_nvml([
        FakeGpu(minor=0, used_mib=3000, compute=[(polite.pid, 1000), (tp_server.pid, 2000)], freed_on_exit=True),
        FakeGpu(uuid="GPU-1", minor=1, used_mib=1000, compute=[(stubborn.pid, 1000)], freed_on_exit=True),
        FakeGpu(uuid="GPU-2", minor=2, used_mib=500, compute=[(kept.pid, 500)], freed_on_exit=True),
        FakeGpu(uuid="GPU-3", minor=3, used_mib=2700, compute=[(tp_server.pid, 2000), (stranger.pid, 700)],
                freed_on_exit=True),
    ])
    unheld = tmp_path / "nvidia-unheld"
    unheld.write_bytes(b"")
    args = {"state": "absent", "device_paths": [str(unheld)], "match": [tag], "protect": ["persistenced"],
            "use_nvml": "always", "grace_s": 1, "kill_wait_s": 5}
    rc, result = run_module(gpu_processes, args, capsys)
    assert rc == 0, result.get("msg")
    stopped = {record["pid"]: (record["gpus"], record["signal"]) for record in result["stopped"]}
    assert stopped == {polite.pid: ([0], "SIGTERM"), tp_server.pid: ([0, 3], "SIGTERM"),
                       stubborn.pid: ([1], "SIGKILL")}
    assert not any(running(child.key) for child in (polite, tp_server, stubborn))
    assert running(kept.key) and running(stranger.key)
    left = {record["pid"]: record for record in result["left"]}
    assert set(left) >= {kept.pid, stranger.pid}
    assert "protected" in str(left[kept.pid]) and "persistenced" in str(left[kept.pid])

    # Zero memory verified on each GPU the holders left; the two still held are named, each with its holder.
    rc, result = run_module(gpu_wait_free, {"gpus": [0, 1], "timeout_s": 5.0, "poll_s": 0.05}, capsys)
    assert rc == 0, result.get("msg")
    assert [(gpu["index"], gpu["memory_used_mib"], gpu["free"]) for gpu in result["gpus"]] == [(0, 0, True),
                                                                                             (1, 0, True)]
    rc, result = run_module(gpu_wait_free, {"timeout_s": 0.5, "poll_s": 0.05, "protect": ["persistenced"]}, capsys)
    assert rc == 1
    message = result["msg"]
    assert "GPU 0 " not in message and "GPU 1 " not in message
    assert "GPU 2 holds 500 MiB" in message and "PID %d" % kept.pid in message and "protected" in message
    assert "GPU 3 holds 700 MiB" in message and "PID %d" % stranger.pid in message
    assert [gpu["free"] for gpu in result["gpus"]] == [True, True, False, False]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"grace_s": -1}, "grace_s must be >= 0 seconds, got -1.0"),
        ({"kill_wait_s": -0.5}, "kill_wait_s must be >= 0 seconds, got -0.5"),
        ({"match": ["sglang", "(oops"]}, "match: '(oops' is not a valid regular expression: "),
        ({"protect": ["[dcgm"]}, "protect: '[dcgm' is not a valid regular expression: "),
        ({"gpus": [0]}, "gpus=[0] needs NVML to map GPU indices to device files, and NVML is unavailable"),
    ],
)
def test_gpu_processes_refuses_bad_options_naming_them(no_pynvml, args, message, capsys):
    rc, result = run_module(gpu_processes, dict({"state": "absent", "use_nvml": "never"}, **args), capsys)
    assert rc == 1
    assert result["msg"].startswith(message)


def test_gpu_processes_refuses_an_unknown_gpu_index(install_nvml, capsys):
    install_nvml([FakeGpu(), FakeGpu()])
    rc, result = run_module(gpu_processes, {"gpus": [5]}, capsys)
    assert rc == 1
    assert result["msg"] == "gpus: GPU 5 does not exist on this host; it has 2 GPU(s) (indices 0-1)"


def test_gpu_processes_names_an_nvml_failure_and_the_way_around_it(install_nvml, capsys):
    lost = FakeNvml.NVML_ERROR_GPU_IS_LOST
    fake = install_nvml([FakeGpu(errors={"nvmlDeviceGetHandleByIndex": lost})])
    rc, result = run_module(gpu_processes, {"gpus": [0]}, capsys)
    assert rc == 1
    assert result["msg"].startswith("NVML query failed while listing the GPUs' processes (gpus=[0]): GPU is lost; ")
    assert "use_nvml: never" in result["msg"]
    assert fake.initialised == 0


def test_gpu_processes_fails_when_nvml_is_required_but_missing(no_pynvml, capsys):
    rc, result = run_module(gpu_processes, {"use_nvml": "always"}, capsys)
    assert rc == 1
    assert result["msg"].startswith("use_nvml=always but NVML is unavailable: the Python package nvidia-ml-py")


# -- gpu_wait_free --------------------------------------------------------------------------


def test_gpu_wait_free_succeeds_once_memory_is_released(install_nvml, capsys):
    fake = install_nvml([FakeGpu(used_mib=900, compute=[(4242, 900)], changes={2: {"used_mib": 0, "compute": []}})])
    rc, result = run_module(gpu_wait_free, {"timeout_s": 10, "poll_s": 0.01}, capsys)
    assert rc == 0, result.get("msg")
    assert result["changed"] is False
    assert result["polls"] == 2
    assert result["gpus"] == [
        {
            "index": 0,
            "memory_used_mib": 0,
            "memory_reserved_mib": 615,
            "processes": [],
            "free": True,
            "pipeline_jobs": [],
            "held_by_pipeline_jobs": False,
        }
    ]
    assert result["held_without_process"] == []
    assert result["held_by_pipeline_jobs"] == []
    assert isinstance(result["freed_at"], float)
    assert fake.initialised == 0


def test_gpu_wait_free_fails_naming_each_holder_and_why_it_was_left(install_nvml, spawn, tag, capsys):
    kept = spawn("--tag", tag + "-persistenced")
    forgotten = spawn("--tag", tag)
    with open("/proc/sys/kernel/pid_max") as handle:
        invisible = int(handle.read()) + 1
    install_nvml(
        [
            FakeGpu(
                used_mib=3000,
                compute=[(kept.pid, 1000), (forgotten.pid, 1000), (os.getpid(), 500), (invisible, None)],
            ),
            FakeGpu(used_mib=512),
            FakeGpu(),
        ]
    )
    args = {"timeout_s": 1.0, "poll_s": 0.05, "protect": ["persistenced"]}
    rc, result = run_module(gpu_wait_free, args, capsys)
    assert rc == 1
    assert result["held_without_process"] == [1]
    assert result["polls"] >= 2
    own_cmdline = " ".join(part for part in Path("/proc/self/cmdline").read_text().split("\0") if part)
    explained = {  # NVML's processes are reported in PID order
        kept.pid: "PID %d (%s, 1000 MiB): protected: matches 'persistenced' "
        "(gpu_reset_protect or gpu_reset_protect_extra)" % (kept.pid, " ".join(kept.popen.args)),
        forgotten.pid: "PID %d (%s, 1000 MiB): selectable, but still running: it was not stopped before this check"
        % (forgotten.pid, " ".join(forgotten.popen.args)),
        os.getpid(): "PID %d (%s, 500 MiB): %s" % (os.getpid(), own_cmdline, RUN_REASON),
        invisible: "PID %d (command line unknown, MiB unknown): not visible from this host's /proc "
        "(another PID namespace?)" % invisible,
    }
    assert result["msg"] == (
        "GPUs not free after 1.0 s: GPU 0 holds 3000 MiB (limit 0 MiB), held by "
        + "; ".join(explained[pid] for pid in sorted(explained))
        + " | GPU 1 holds 512 MiB (limit 0 MiB): no process holds it: driver state; see gpu_reset_smi_reset "
        "(nvidia-smi -r on that GPU) or reboot the host"
    )
    assert running(kept.key) and running(forgotten.key)  # waiting never signals


def test_gpu_wait_free_names_an_nvml_failure_while_polling(install_nvml, capsys):
    lost = FakeNvml.NVML_ERROR_GPU_IS_LOST
    fake = install_nvml([FakeGpu(used_mib=10, changes={2: {"errors": {"nvmlDeviceGetMemoryInfo": lost}}})])
    rc, result = run_module(gpu_wait_free, {"timeout_s": 10, "poll_s": 0.01}, capsys)
    assert rc == 1
    assert result["msg"].startswith("NVML query failed while waiting for the GPUs to be free (gpus=all): GPU is lost; ")
    assert fake.initialised == 0


def test_gpu_wait_free_fails_without_nvml(no_pynvml, capsys):
    rc, result = run_module(gpu_wait_free, {}, capsys)
    assert rc == 1
    assert result["msg"].startswith("cannot verify that GPUs are free: the Python package nvidia-ml-py")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"max_used_mib": -1}, "max_used_mib must be >= 0, got -1"),
        ({"timeout_s": -1}, "timeout_s must be >= 0 seconds, got -1.0"),
        ({"poll_s": 0}, "poll_s must be > 0 seconds, got 0.0"),
        ({"match": ["("]}, "match: '(' is not a valid regular expression: "),
        ({"protect": ["+x"]}, "protect: '+x' is not a valid regular expression: "),
        ({"gpus": [2]}, "gpus: GPU 2 does not exist on this host; it has 2 GPU(s) (indices 0-1)"),
        ({"gpus": ["zero"]}, "gpus: 'zero' is not a GPU index; give 'all' or a list of integers"),
    ],
)
def test_gpu_wait_free_refuses_bad_options_naming_them(install_nvml, args, message, capsys):
    fake = install_nvml([FakeGpu(), FakeGpu()])
    rc, result = run_module(gpu_wait_free, args, capsys)
    assert rc == 1
    assert result["msg"].startswith(message)
    assert fake.initialised == 0
