"""gpu_nvml: the read-only NVML view, against the pynvml stand-in."""

from __future__ import annotations

import sys

import pytest
from ansible.module_utils.gpu_nvml import (
    NvmlUnavailable,
    health_problems,
    load_nvml,
    memory_mib,
    read_gpu,
    running_processes,
    select_indices,
)
from fake_nvml import FakeGpu, FakeNvml


def started(*gpus, **kwargs):
    """A FakeNvml over the given GPUs, initialised as load_nvml leaves it."""
    return load_nvml(FakeNvml(list(gpus), **kwargs))


def handle(nvml, index=0):
    return nvml.nvmlDeviceGetHandleByIndex(index)


# -- memory -------------------------------------------------------------------------------


def test_memory_used_comes_from_the_v2_call_without_the_driver_reservation():
    nvml = started(FakeGpu(used_mib=0, reserved_mib=615))
    assert nvml.nvmlDeviceGetMemoryInfo(handle(nvml)).used // (1024 * 1024) == 615  # what v1 says
    assert memory_mib(nvml, handle(nvml)) == (143771, 0, 615)


def test_memory_falls_back_to_v1_when_the_driver_has_no_v2_call():
    nvml = started(FakeGpu(used_mib=1000, reserved_mib=615), v2_memory=False)
    total, used, reserved = memory_mib(nvml, handle(nvml))
    assert (total, used, reserved) == (143771, 1615, None)


def test_read_gpu_reports_v2_used_memory_of_an_idle_gpu_as_zero():
    gpu = read_gpu(started(FakeGpu(used_mib=0, reserved_mib=615)), 0)
    assert gpu["memory_used_mib"] == 0
    assert gpu["memory_reserved_mib"] == 615


# -- processes ----------------------------------------------------------------------------


def test_running_processes_merges_compute_and_graphics_by_pid():
    nvml = started(FakeGpu(compute=[(300, 5000), (100, None)], graphics=[(300, 7000), (200, 64)]))
    assert running_processes(nvml, handle(nvml)) == [
        {"pid": 100, "used_mib": None, "kind": "compute"},
        {"pid": 200, "used_mib": 64, "kind": "graphics"},
        {"pid": 300, "used_mib": 7000, "kind": "compute+graphics"},
    ]


def test_running_processes_of_a_gpu_without_graphics_query_are_its_compute_ones():
    nvml = started(FakeGpu(compute=[(42, 10)], unsupported={"nvmlDeviceGetGraphicsRunningProcesses"}))
    assert running_processes(nvml, handle(nvml)) == [{"pid": 42, "used_mib": 10, "kind": "compute"}]


# -- unsupported queries --------------------------------------------------------------------


def test_unsupported_queries_become_none_and_the_rest_is_still_read():
    unsupported = {
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetTemperatureThreshold",
        "nvmlDeviceGetPersistenceMode",
        "nvmlDeviceGetMinorNumber",
        "nvmlDeviceGetUUID",
    }
    nvml = started(FakeGpu(name="NVIDIA A100", used_mib=12, unsupported=unsupported))
    with pytest.raises(nvml.NVMLError, match="Not Supported"):
        nvml.nvmlDeviceGetRemappedRows(handle(nvml))
    gpu = read_gpu(nvml, 0)
    for key in (
        "uuid",
        "minor_number",
        "temperature_c",
        "temperature_slowdown_c",
        "ecc_volatile_uncorrected",
        "remapped_rows_pending",
        "remapped_rows_failed",
        "remapped_rows_uncorrectable",
        "persistence_mode",
    ):
        assert gpu[key] is None, key
    assert gpu["name"] == "NVIDIA A100"
    assert gpu["memory_used_mib"] == 12
    assert health_problems(gpu) == []


def test_read_gpu_reads_each_counter_with_the_right_nvml_constant():
    gpu = read_gpu(
        started(
            FakeGpu(
                uuid="GPU-abc",
                minor=3,
                ecc_volatile_uncorrected=2,
                remapped=(5, 1, 1, 0),
                temperature_c=40,
                slowdown_c=87,
                shutdown_c=92,
                persistence=0,
            )
        ),
        0,
    )
    assert gpu["uuid"] == "GPU-abc"
    assert gpu["minor_number"] == 3
    assert gpu["ecc_volatile_uncorrected"] == 2  # not the corrected (7) or aggregate (11) count
    assert gpu["remapped_rows_uncorrectable"] == 1
    assert gpu["remapped_rows_pending"] is True
    assert gpu["remapped_rows_failed"] is False
    assert gpu["temperature_c"] == 40
    assert gpu["temperature_slowdown_c"] == 87  # not the shutdown threshold
    assert gpu["persistence_mode"] is False


# -- select_indices -----------------------------------------------------------------------


def test_select_indices_all_and_none_mean_every_gpu():
    assert select_indices("all", 3) == [0, 1, 2]
    assert select_indices(None, 2) == [0, 1]
    assert select_indices("all", 0) == []


def test_select_indices_sorts_and_deduplicates_a_list():
    assert select_indices([2, "0", 2], 3) == [0, 2]
    assert select_indices(1, 2) == [1]


def test_select_indices_names_the_missing_gpu_and_the_count():
    with pytest.raises(ValueError) as exc:
        select_indices([0, 8], 8)
    assert str(exc.value) == "gpus: GPU 8 does not exist on this host; it has 8 GPU(s) (indices 0-7)"
    with pytest.raises(ValueError, match=r"GPU -1 does not exist"):
        select_indices([-1], 8)
    with pytest.raises(ValueError, match=r"GPU 0 does not exist on this host; it has 0 GPU\(s\)$"):
        select_indices([0], 0)


@pytest.mark.parametrize("bad", ["first", [None], ["0,1"]])
def test_select_indices_refuses_what_is_not_an_integer(bad):
    with pytest.raises(ValueError, match=r"is not a GPU index; give 'all' or a list of integers"):
        select_indices(bad, 4)


@pytest.mark.parametrize("bad", [1.5, True])
def test_select_indices_refuses_a_fractional_or_boolean_index(bad):
    # int() would quietly turn 1.5 into GPU 1 and True into GPU 1.
    with pytest.raises(ValueError, match=r"is not a GPU index"):
        select_indices([bad], 4)


# -- health -------------------------------------------------------------------------------


def healthy(**changes):
    gpu = read_gpu(started(FakeGpu(uuid="GPU-h", temperature_c=40, slowdown_c=87)), 0)
    gpu.update(changes)
    return gpu


def test_a_healthy_gpu_has_no_problems():
    assert health_problems(healthy()) == []


def test_ecc_errors_are_a_problem_naming_the_gpu_unless_ecc_checks_are_off():
    gpu = healthy(ecc_volatile_uncorrected=3)
    (problem,) = health_problems(gpu)
    assert problem.startswith("GPU 0 (GPU-h) has 3 volatile uncorrected ECC error(s)")
    assert "dcgmi diag" in problem
    assert health_problems(gpu, check_ecc=False) == []


def test_remapped_rows_pending_and_failed_are_problems_unless_checks_are_off():
    gpu = healthy(remapped_rows_pending=True, remapped_rows_failed=True)
    problems = health_problems(gpu)
    assert len(problems) == 2
    assert "GPU 0 (GPU-h) reports a failed row remapping" in problems[0]
    assert "RMA" in problems[0]
    assert "GPU 0 (GPU-h) has a row remapping pending" in problems[1]
    assert "nvidia-smi -r" in problems[1]
    assert health_problems(gpu, check_remapped_rows=False) == []


def test_temperature_is_checked_against_an_explicit_limit():
    gpu = healthy(temperature_c=80)
    (problem,) = health_problems(gpu, max_temperature_c=80)
    assert problem.startswith("GPU 0 (GPU-h) is at 80 C, at or above the limit of 80 C")
    assert health_problems(gpu, max_temperature_c=81) == []


def test_temperature_is_checked_against_the_slowdown_threshold_without_a_limit():
    assert health_problems(healthy(temperature_c=86)) == []
    (problem,) = health_problems(healthy(temperature_c=87))
    assert "at or above the limit of 87 C" in problem


def test_unknown_uuid_is_said_so_in_the_problem():
    gpu = healthy(ecc_volatile_uncorrected=1, uuid=None)
    assert health_problems(gpu)[0].startswith("GPU 0 (uuid unknown) has 1 volatile")


# -- load_nvml ----------------------------------------------------------------------------


def test_load_nvml_raises_nvml_unavailable_when_init_fails():
    with pytest.raises(NvmlUnavailable) as exc:
        load_nvml(FakeNvml([FakeGpu()], init_error=FakeNvml.NVML_ERROR_DRIVER_NOT_LOADED))
    assert str(exc.value) == "NVML could not be initialised: Driver Not Loaded (is the NVIDIA driver loaded?)"


def test_load_nvml_without_the_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(NvmlUnavailable, match=r"nvidia-ml-py \(module pynvml\) is not installed"):
        load_nvml()


def test_load_nvml_initialises_the_library():
    fake = FakeNvml([FakeGpu()])
    assert load_nvml(fake) is fake
    assert fake.initialised == 1
