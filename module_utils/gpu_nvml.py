"""A read-only view of NVIDIA GPUs through NVML (the nvidia-ml-py package, imported as pynvml).

Every query that a GPU or driver does not support becomes ``None`` ("unknown") instead of an
error, so one old board or a restricted container never hides the state of the others.
Memory is read with the v2 call: the v1 call counts memory the driver reserves for itself
(about 615 MiB on an idle H200) as used, so "zero used" could never be reached with it.
"""

from __future__ import absolute_import, division, print_function

import glob
import os
import sys

MIB = 1024 * 1024

# Where an NVIDIA driver shows itself even when NVML cannot be loaded by this Python.
DRIVER_MARKERS = ("/proc/driver/nvidia/version", "/dev/nvidiactl")


# What to do when an NVML query fails on a GPU (rather than being unsupported by it).
NVML_FAILURE_REMEDY = (
    "look for Xid errors in the kernel log (dmesg); a GPU that is lost or needs a reset "
    "takes nvidia-smi -r on it, or a reboot"
)


class NvmlUnavailable(Exception):
    """NVML cannot be used on this host; ``str()`` says why and what to do."""


def driver_detected(markers=DRIVER_MARKERS):
    """True when the host shows an NVIDIA kernel driver (proc entry or control device)."""
    return any(os.path.exists(path) for path in markers) or bool(glob.glob("/dev/nvidia[0-9]*"))


def load_nvml(nvml=None):
    """Import (unless given) and initialise NVML; return the pynvml module.

    Raises NvmlUnavailable with the cause and the remedy when the package or the driver is
    missing. ``nvml`` lets tests pass a stand-in module with the same functions.
    """
    if nvml is None:
        try:
            import pynvml as nvml  # noqa: PLC0415 - optional on hosts without GPUs
        except ImportError as exc:
            raise NvmlUnavailable(
                "the Python package nvidia-ml-py (module pynvml) is not installed for %s (%s); "
                "install it there (pip install nvidia-ml-py) or let the gpu_reset role create "
                "its venv (gpu_reset_nvml_venv)" % (sys.executable, exc)
            ) from exc
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        raise NvmlUnavailable("NVML could not be initialised: %s (is the NVIDIA driver loaded?)" % _text(exc)) from exc
    return nvml


def _text(value):
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _maybe(nvml, fn, *args, **kwargs):
    """Call an NVML function; an unsupported or forbidden query gives None, not an error."""
    try:
        return fn(*args, **kwargs)
    except nvml.NVMLError:
        return None


def driver_version(nvml):
    """The driver version string, or None."""
    value = _maybe(nvml, nvml.nvmlSystemGetDriverVersion)
    return None if value is None else _text(value)


def device_count(nvml):
    """Number of GPUs NVML sees."""
    return nvml.nvmlDeviceGetCount()


def handles(nvml, indices):
    """NVML handles for the given GPU indices, in order."""
    return [nvml.nvmlDeviceGetHandleByIndex(i) for i in indices]


def minor_number(nvml, handle):
    """The GPU's device-file number (/dev/nvidia<minor>), or None."""
    return _maybe(nvml, nvml.nvmlDeviceGetMinorNumber, handle)


def memory_mib(nvml, handle):
    """(total, used, reserved) MiB from the v2 memory call; falls back to v1 (reserved None).

    The fallback only exists for drivers older than the v2 call; its "used" includes the
    driver's reservation, which the caller sees through ``reserved`` being None.
    """
    try:
        info = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
        return info.total // MIB, info.used // MIB, info.reserved // MIB
    except (nvml.NVMLError, AttributeError, TypeError):
        info = nvml.nvmlDeviceGetMemoryInfo(handle)
        return info.total // MIB, info.used // MIB, None


def running_processes(nvml, handle):
    """Processes on one GPU: list of dicts pid, used_mib (None when unknown), kind.

    Compute and graphics lists are merged and deduplicated by PID (a process can be in both).
    """
    seen = {}
    for kind, fn_name in (
        ("compute", "nvmlDeviceGetComputeRunningProcesses"),
        ("graphics", "nvmlDeviceGetGraphicsRunningProcesses"),
    ):
        fn = getattr(nvml, fn_name, None)
        procs = _maybe(nvml, fn, handle) if fn else None
        for proc in procs or []:
            used = getattr(proc, "usedGpuMemory", None)
            entry = seen.get(proc.pid)
            if entry is None:
                seen[proc.pid] = {
                    "pid": int(proc.pid),
                    "used_mib": None if used is None else int(used) // MIB,
                    "kind": kind,
                }
            else:
                entry["kind"] = "compute+graphics"
                if used is not None:
                    entry["used_mib"] = max(entry["used_mib"] or 0, int(used) // MIB)
    return sorted(seen.values(), key=lambda p: p["pid"])


def read_gpu(nvml, index, handle=None):
    """Everything gpu_info reports about one GPU, as a plain dict."""
    if handle is None:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
    total, used, reserved = memory_mib(nvml, handle)
    remapped = _maybe(nvml, nvml.nvmlDeviceGetRemappedRows, handle)
    ecc = _maybe(
        nvml,
        nvml.nvmlDeviceGetTotalEccErrors,
        handle,
        nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        nvml.NVML_VOLATILE_ECC,
    )
    persistence = _maybe(nvml, nvml.nvmlDeviceGetPersistenceMode, handle)
    name = _maybe(nvml, nvml.nvmlDeviceGetName, handle)
    uuid = _maybe(nvml, nvml.nvmlDeviceGetUUID, handle)
    return {
        "index": index,
        "uuid": None if uuid is None else _text(uuid),
        "name": None if name is None else _text(name),
        "minor_number": minor_number(nvml, handle),
        "memory_total_mib": total,
        "memory_used_mib": used,
        "memory_reserved_mib": reserved,
        "processes": running_processes(nvml, handle),
        "temperature_c": _maybe(nvml, nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU),
        "temperature_slowdown_c": _maybe(
            nvml, nvml.nvmlDeviceGetTemperatureThreshold, handle, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
        ),
        "ecc_volatile_uncorrected": None if ecc is None else int(ecc),
        "remapped_rows_pending": None if remapped is None else bool(remapped[2]),
        "remapped_rows_failed": None if remapped is None else bool(remapped[3]),
        "remapped_rows_uncorrectable": None if remapped is None else int(remapped[1]),
        "persistence_mode": None if persistence is None else bool(persistence),
    }


def select_indices(requested, count):
    """Turn ``"all"`` or a list of indices into a sorted list; raise ValueError naming bad ones."""
    if requested in (None, "all"):
        return list(range(count))
    if isinstance(requested, (str, int)):
        requested = [requested]
    indices = []
    for item in requested:
        try:
            # int() alone would quietly take 1.5 or True as GPU 1.
            if isinstance(item, bool) or (isinstance(item, float) and not item.is_integer()):
                raise ValueError(item)
            value = int(item)
        except (TypeError, ValueError):
            raise ValueError("gpus: %r is not a GPU index; give 'all' or a list of integers" % (item,)) from None
        if value < 0 or value >= count:
            raise ValueError(
                "gpus: GPU %d does not exist on this host; it has %d GPU(s)%s"
                % (value, count, " (indices 0-%d)" % (count - 1) if count else "")
            )
        if value not in indices:
            indices.append(value)
    return sorted(indices)


def health_problems(gpu, max_temperature_c=None, check_ecc=True, check_remapped_rows=True):
    """Human-readable health problems of one GPU (a dict from read_gpu); empty when healthy.

    ``max_temperature_c`` None means the GPU's own slowdown threshold, when NVML knows it.
    Each message names the GPU and what to do about it.
    """
    label = "GPU %s (%s)" % (gpu["index"], gpu.get("uuid") or "uuid unknown")
    problems = []
    if check_ecc and gpu.get("ecc_volatile_uncorrected"):
        problems.append(
            "%s has %d volatile uncorrected ECC error(s) since the driver loaded: its results "
            "cannot be trusted; drain the host and run the vendor diagnostics (dcgmi diag -r 3) "
            "before using it" % (label, gpu["ecc_volatile_uncorrected"])
        )
    if check_remapped_rows and gpu.get("remapped_rows_failed"):
        problems.append(
            "%s reports a failed row remapping: the board needs service (RMA)" % label
        )
    if check_remapped_rows and gpu.get("remapped_rows_pending"):
        problems.append(
            "%s has a row remapping pending: it takes effect after a GPU reset "
            "(nvidia-smi -r with no process on it, or a reboot)" % label
        )
    limit = max_temperature_c if max_temperature_c is not None else gpu.get("temperature_slowdown_c")
    temp = gpu.get("temperature_c")
    if limit is not None and temp is not None and temp >= limit:
        problems.append(
            "%s is at %d C, at or above the limit of %d C: check cooling before a long run"
            % (label, temp, limit)
        )
    return problems
