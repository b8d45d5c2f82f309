"""What the host did while a benchmark ran: its facts once, then one sample every few seconds (JSON lines).

Two runs of the same benchmark on two machines of the same kind can differ by 2x (docs/benchmarks.md, all of
ShareGPT), and the figures alone do not say why: slower cores, a page cache too small for the stored states, a
disk that reads slowly, or another tenant's process on the same GPU. ``host_facts`` records the machine;
``HostWatch`` samples, in a daemon thread, each ``interval_s``:

- ``cpu_busy_pct``, ``cpu_iowait_pct``: all cores since the last sample (``/proc/stat``);
- ``mem_available_gib``, ``page_cache_gib`` (``/proc/meminfo``);
- ``disk_read_mb_s``, ``disk_write_mb_s``: what the kernel paged in and out (``/proc/vmstat`` pgpgin/pgpgout, KiB);
- ``gpus``: per GPU its utilisation, used memory and compute processes, each marked ``ours`` when this process
  or one of its descendants holds it, and ``visible`` when its pid is in this PID namespace at all (a container
  may see the host's pids from NVML: such a process cannot be told ours or not) (NVML; absent without it).

``summary`` condenses a span of samples (a stage's) into means and maxima, and lists the GPU processes that were
not ours and those of another PID namespace: what ``bench/fidelity.py`` prints beside its stage times and keeps in
its record.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

GIB = 2**30


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _meminfo() -> dict[str, float]:
    values = {}
    for line in _read("/proc/meminfo").splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            values[name] = int(parts[0]) * 1024 / GIB  # kB
    return values


def _cpu_times() -> tuple[int, int, int] | None:
    """(total, idle, iowait) jiffies of all cores."""
    for line in _read("/proc/stat").splitlines():
        if line.startswith("cpu "):
            fields = [int(x) for x in line.split()[1:]]
            idle, iowait = fields[3], fields[4] if len(fields) > 4 else 0
            return sum(fields[:8]), idle, iowait
    return None


def _paged_kib() -> tuple[int, int] | None:
    values = dict(line.split() for line in _read("/proc/vmstat").splitlines() if line.count(" ") == 1)
    try:
        return int(values["pgpgin"]), int(values["pgpgout"])
    except (KeyError, ValueError):
        return None


def _parent(pid: int) -> int | None:
    stat = _read(f"/proc/{pid}/stat")
    try:  # the command may hold spaces and parentheses: the fields after the last ')' are fixed
        return int(stat.rpartition(")")[2].split()[1])
    except (IndexError, ValueError):
        return None


def is_ours(pid: int, root: int | None = None) -> bool:
    """Whether ``pid`` is ``root`` (default: this process) or one of its descendants."""
    root = os.getpid() if root is None else root
    seen = 0
    while pid and pid > 1 and seen < 64:
        if pid == root:
            return True
        pid, seen = _parent(pid), seen + 1
    return pid == root


def _nvml():
    try:
        import pynvml  # noqa: PLC0415 - optional: hosts without a GPU

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # noqa: BLE001 - no library, no driver, no GPU: no GPU fields
        return None


def _gpus(nvml, root: int) -> list[dict] | None:
    if nvml is None:
        return None
    gpus = []
    try:
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            util = nvml.nvmlDeviceGetUtilizationRates(handle)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            processes = [{"pid": p.pid, "used_gib": (p.usedGpuMemory or 0) / GIB, "ours": is_ours(p.pid, root),
                          "visible": os.path.exists(f"/proc/{p.pid}")}
                         for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)]
            gpus.append({"index": index, "util_pct": util.gpu, "memory_used_gib": memory.used / GIB,
                         "processes": processes})
    except Exception as exc:  # noqa: BLE001 - a sample without GPU fields, with the reason
        return [{"error": f"{type(exc).__name__}: {exc}"}]
    return gpus


def host_facts(work_dir: Path | None = None) -> dict:
    """The machine: CPU model and cores, memory, the cgroup's memory limit, free disk, GPUs."""
    model = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                  if line.startswith("model name")), None)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = _meminfo()
    limit = _read("/sys/fs/cgroup/memory.max").strip() or None
    facts = {"cpu_model": model, "cpu_count": os.cpu_count(), "cpus_usable": usable,
             "mem_total_gib": memory.get("MemTotal"), "mem_available_gib": memory.get("MemAvailable"),
             "cgroup_memory_max": limit, "gpus": None}
    if work_dir is not None:
        facts["disk_free_gib"] = shutil.disk_usage(work_dir).free / GIB
    nvml = _nvml()
    if nvml is not None:
        try:
            facts["gpus"] = []
            for index in range(nvml.nvmlDeviceGetCount()):
                name = nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(index))
                facts["gpus"].append(name.decode() if isinstance(name, bytes) else name)
        except Exception as exc:  # noqa: BLE001
            facts["gpus"] = [f"{type(exc).__name__}: {exc}"]
    return facts


class HostWatch:
    """A daemon thread appending a sample to ``path`` every ``interval_s`` (the first one at once) until ``stop``."""

    def __init__(self, path: Path, interval_s: float = 15.0, root: int | None = None):
        self.path, self.interval_s = Path(path), interval_s
        self.root = os.getpid() if root is None else root
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-watch", daemon=True)
        self._nvml = None

    def start(self) -> HostWatch:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._nvml = _nvml()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        last_cpu, last_paged, last_t = _cpu_times(), _paged_kib(), time.time()
        with self.path.open("a") as out:
            while True:
                now, cpu, paged = time.time(), _cpu_times(), _paged_kib()
                memory = _meminfo()
                sample = {"t": round(now, 3), "mem_available_gib": memory.get("MemAvailable"),
                          "page_cache_gib": memory.get("Cached")}
                if cpu and last_cpu and cpu[0] > last_cpu[0]:
                    total = cpu[0] - last_cpu[0]
                    sample["cpu_busy_pct"] = 100.0 * (total - (cpu[1] - last_cpu[1]) - (cpu[2] - last_cpu[2])) / total
                    sample["cpu_iowait_pct"] = 100.0 * (cpu[2] - last_cpu[2]) / total
                if paged and last_paged and now > last_t:
                    sample["disk_read_mb_s"] = (paged[0] - last_paged[0]) * 1024 / 1e6 / (now - last_t)
                    sample["disk_write_mb_s"] = (paged[1] - last_paged[1]) * 1024 / 1e6 / (now - last_t)
                gpus = _gpus(self._nvml, self.root)
                if gpus is not None:
                    sample["gpus"] = gpus
                out.write(json.dumps(sample) + "\n")
                out.flush()
                last_cpu, last_paged, last_t = cpu, paged, now
                if self._stop.wait(self.interval_s):
                    return


def read_samples(path: Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summary(samples: list[dict], since: float | None = None, until: float | None = None) -> dict:
    """Means and maxima of the samples in [since, until]; the GPU processes seen there that were not ours, and those
    whose pid this namespace does not show (ours or not: unknown)."""
    span = [s for s in samples if (since is None or s["t"] >= since) and (until is None or s["t"] <= until)]

    def mean(name):
        values = [s[name] for s in span if s.get(name) is not None]
        return sum(values) / len(values) if values else None

    def peak(name):
        values = [s[name] for s in span if s.get(name) is not None]
        return max(values) if values else None

    others: dict[int, float] = {}
    elsewhere: dict[int, float] = {}
    util = []
    for sample in span:
        for gpu in sample.get("gpus") or []:
            if "util_pct" in gpu:
                util.append(gpu["util_pct"])
            for process in gpu.get("processes", []):
                if process["ours"]:
                    continue
                into = others if process.get("visible", True) else elsewhere
                into[process["pid"]] = max(into.get(process["pid"], 0.0), process["used_gib"])
    return {"samples": len(span), "cpu_busy_pct_mean": mean("cpu_busy_pct"),
            "cpu_iowait_pct_mean": mean("cpu_iowait_pct"), "disk_read_mb_s_max": peak("disk_read_mb_s"),
            "disk_write_mb_s_max": peak("disk_write_mb_s"),
            "page_cache_gib_min": min((s["page_cache_gib"] for s in span if s.get("page_cache_gib") is not None),
                                      default=None),
            "gpu_util_pct_mean": sum(util) / len(util) if util else None,
            "gpu_processes_not_ours": [{"pid": pid, "used_gib_max": used} for pid, used in sorted(others.items())],
            "gpu_processes_elsewhere": [{"pid": pid, "used_gib_max": used} for pid, used in sorted(elsewhere.items())]}


def describe(stats: dict) -> str:
    """One line of ``summary``'s figures."""
    def fmt(value, unit, digits=0):
        return "n/a" if value is None else f"{value:.{digits}f}{unit}"

    others, elsewhere = stats["gpu_processes_not_ours"], stats.get("gpu_processes_elsewhere") or []
    if stats["gpu_util_pct_mean"] is None and not others and not elsewhere:
        gpu = "no GPU watched (no NVML)"
    else:
        gpu = f"GPU busy {fmt(stats['gpu_util_pct_mean'], ' %')}, " + (
            f"{len(others)} other process(es) on the GPU: "
            + ", ".join(f"pid {o['pid']} ({o['used_gib_max']:.1f} GiB)" for o in others)
            if others else "no other process on the GPU") + (
            f", {len(elsewhere)} of another PID namespace: "
            + ", ".join(f"pid {o['pid']} ({o['used_gib_max']:.1f} GiB)" for o in elsewhere) if elsewhere else "")
    return (f"CPU busy {fmt(stats['cpu_busy_pct_mean'], ' %')} (iowait {fmt(stats['cpu_iowait_pct_mean'], ' %', 1)}), "
            f"disk read up to {fmt(stats['disk_read_mb_s_max'], ' MB/s')}, write up to "
            f"{fmt(stats['disk_write_mb_s_max'], ' MB/s')}, page cache at least "
            f"{fmt(stats['page_cache_gib_min'], ' GiB', 1)}, {gpu} ({stats['samples']} samples)")
