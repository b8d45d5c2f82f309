"""gpu_free: polling NVML (the stand-in) until GPUs are free, and the message when they are not."""

from __future__ import annotations

from ansible.module_utils.gpu_free import gpu_state, held_message, held_without_process, wait_free
from ansible.module_utils.gpu_nvml import load_nvml
from fake_nvml import FakeGpu, FakeNvml


def wait(gpus, max_used_mib=0, timeout_s=10.0, poll_s=0.01):
    nvml = load_nvml(FakeNvml(gpus))
    indices = list(range(len(gpus)))
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
    return wait_free(nvml, indices, handles, max_used_mib, timeout_s, poll_s)


def test_wait_free_returns_once_the_gpu_is_freed_on_the_third_poll():
    gpu = FakeGpu(used_mib=70000, compute=[(4242, 70000)], changes={3: {"used_mib": 0, "compute": []}})
    ok, states, seconds, polls = wait([gpu], timeout_s=10.0, poll_s=0.01)
    assert ok is True
    assert polls == 3
    assert gpu.memory_reads == 3
    assert states == [{"index": 0, "memory_used_mib": 0, "memory_reserved_mib": 615, "processes": [], "free": True}]
    assert 2 * 0.01 <= seconds < 10.0  # two polls' sleeps before the third, and no timeout


def test_wait_free_waits_for_every_gpu():
    early = FakeGpu(used_mib=10, changes={2: {"used_mib": 0}})
    late = FakeGpu(used_mib=0, compute=[(7, None)], changes={5: {"compute": []}})
    ok, states, _seconds, polls = wait([early, late])
    assert ok is True
    assert polls == 5
    assert [s["free"] for s in states] == [True, True]


def test_an_idle_gpu_with_the_driver_reservation_is_free_at_once():
    ok, states, _seconds, polls = wait([FakeGpu(used_mib=0, reserved_mib=615)])
    assert (ok, polls) == (True, 1)
    assert states[0]["memory_reserved_mib"] == 615


def test_wait_free_times_out_with_the_last_states_when_memory_stays():
    gpu = FakeGpu(used_mib=1000, compute=[(4242, 1000)])
    ok, states, seconds, polls = wait([gpu, FakeGpu()], timeout_s=1.0, poll_s=0.05)
    assert ok is False
    assert seconds >= 1.0
    assert polls >= 2
    assert states == [
        {
            "index": 0,
            "memory_used_mib": 1000,
            "memory_reserved_mib": 615,
            "processes": [{"pid": 4242, "used_mib": 1000, "kind": "compute"}],
            "free": False,
        },
        {"index": 1, "memory_used_mib": 0, "memory_reserved_mib": 615, "processes": [], "free": True},
    ]


def test_a_timeout_of_zero_polls_once():
    ok, _states, _seconds, polls = wait([FakeGpu(used_mib=5)], timeout_s=0)
    assert (ok, polls) == (False, 1)


def test_memory_within_the_limit_is_free_only_without_processes():
    nvml = load_nvml(FakeNvml([FakeGpu(used_mib=5), FakeGpu(used_mib=5, compute=[(9, 5)])]))
    within, with_process = (gpu_state(nvml, i, nvml.nvmlDeviceGetHandleByIndex(i), 10) for i in (0, 1))
    assert within["free"] is True
    assert with_process["free"] is False
    assert gpu_state(nvml, 0, nvml.nvmlDeviceGetHandleByIndex(0), 4)["free"] is False


def held_states():
    return [
        {"index": 0, "memory_used_mib": 0, "memory_reserved_mib": 615, "processes": [], "free": True},
        {
            "index": 1,
            "memory_used_mib": 71000,
            "memory_reserved_mib": 615,
            "processes": [
                {"pid": 4242, "used_mib": 70000, "kind": "compute"},
                {"pid": 4300, "used_mib": None, "kind": "compute"},
            ],
            "free": False,
        },
        {"index": 2, "memory_used_mib": 512, "memory_reserved_mib": 615, "processes": [], "free": False},
    ]


def test_held_message_names_each_gpu_its_mib_and_each_holder_with_the_reason():
    reasons = {
        4242: ("nv-hostengine -n", "protected: matches 'nv-hostengine' (gpu_reset_protect or gpu_reset_protect_extra)"),
        4300: ("python train.py", "not matched by any pattern of gpu_reset_match"),
    }
    message = held_message(held_states(), 0, 60.0, reasons.__getitem__)
    assert message == (
        "GPUs not free after 60.0 s: "
        "GPU 1 holds 71000 MiB (limit 0 MiB), held by "
        "PID 4242 (nv-hostengine -n, 70000 MiB): protected: matches 'nv-hostengine' "
        "(gpu_reset_protect or gpu_reset_protect_extra); "
        "PID 4300 (python train.py, MiB unknown): not matched by any pattern of gpu_reset_match | "
        "GPU 2 holds 512 MiB (limit 0 MiB): no process holds it: driver state; see gpu_reset_smi_reset "
        "(nvidia-smi -r on that GPU) or reboot the host"
    )
    assert "GPU 0" not in message


def test_held_without_process_lists_gpus_held_by_no_process():
    assert held_without_process(held_states()) == [2]
    assert held_without_process(held_states()[:2]) == []
