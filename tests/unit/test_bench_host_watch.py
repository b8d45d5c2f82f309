"""bench/host_watch.py: the machine's facts, samples of a real busy CPU, which processes are this one's, and the
summary that names the GPU processes that were not ours (samples written as NVML would fill them: no GPU here)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import host_watch  # noqa: E402


def test_host_facts_name_the_machine(tmp_path):
    facts = host_watch.host_facts(tmp_path)
    assert facts["cpu_count"] >= 1 and 1 <= facts["cpus_usable"] <= facts["cpu_count"]
    assert facts["mem_total_gib"] > 0 and 0 < facts["mem_available_gib"] <= facts["mem_total_gib"]
    assert facts["disk_free_gib"] > 0


def test_samples_see_a_busy_cpu(tmp_path):
    path = tmp_path / "host.jsonl"
    watch = host_watch.HostWatch(path, interval_s=0.1).start()
    until = time.time() + 0.6
    while time.time() < until:  # one core busy for 0.6 s
        sum(i * i for i in range(1000))
    watch.stop()
    samples = host_watch.read_samples(path)
    assert len(samples) >= 3
    assert [s["t"] for s in samples] == sorted(s["t"] for s in samples)
    busy = [s["cpu_busy_pct"] for s in samples if "cpu_busy_pct" in s]
    assert busy and all(0 <= b <= 100 for b in busy)
    stats = host_watch.summary(samples)
    assert stats["samples"] == len(samples) and stats["cpu_busy_pct_mean"] > 0
    assert "no GPU watched" in host_watch.describe(stats)


def test_ours_means_this_process_and_its_descendants():
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                              "subprocess.run([sys.executable, '-c', 'import time; time.sleep(5)'])"])
    try:
        grandchild = None
        for _ in range(100):
            found = [int(name) for name in os.listdir("/proc")
                     if name.isdigit() and host_watch._parent(int(name)) == child.pid]
            if found:
                grandchild = int(found[0])
                break
            time.sleep(0.05)
        assert host_watch.is_ours(os.getpid()) and host_watch.is_ours(child.pid)
        assert grandchild is not None and host_watch.is_ours(grandchild)
        assert not host_watch.is_ours(os.getppid())
        assert not host_watch.is_ours(grandchild, root=os.getppid() + 10**7)  # a root that does not exist
    finally:
        child.kill()
        child.wait()


def test_summary_names_the_gpu_processes_that_were_not_ours():
    def sample(t, processes):
        return {"t": t, "cpu_busy_pct": 50.0, "gpus": [{"index": 0, "util_pct": 80, "memory_used_gib": 9.0,
                                                        "processes": processes}]}

    ours = {"pid": 100, "used_gib": 4.0, "ours": True, "visible": True}
    tenant = {"pid": 200, "used_gib": 2.0, "ours": False, "visible": True}
    hidden = {"pid": 300, "used_gib": 1.5, "ours": False, "visible": False}
    samples = [sample(1.0, [ours]), sample(2.0, [ours, tenant]), sample(3.0, [ours, dict(tenant, used_gib=3.0),
                                                                                hidden]), sample(9.0, [ours])]
    stats = host_watch.summary(samples, since=1.5, until=3.5)
    assert stats["samples"] == 2 and stats["gpu_util_pct_mean"] == 80
    assert stats["gpu_processes_not_ours"] == [{"pid": 200, "used_gib_max": 3.0}]
    assert stats["gpu_processes_elsewhere"] == [{"pid": 300, "used_gib_max": 1.5}]
    line = host_watch.describe(stats)
    assert "1 other process(es) on the GPU: pid 200 (3.0 GiB)" in line and "pid 300" in line
    assert host_watch.summary(samples, since=8.0)["gpu_processes_not_ours"] == []
