"""A stand-in for the pynvml module (nvidia-ml-py), for unit tests on hosts without a GPU.

It is the only fake the unit tests use. ``FakeNvml`` has pynvml's function, constant and
error names, so an instance can sit in ``sys.modules["pynvml"]`` and the code under test
imports it as it would import the real package. Its GPUs (``FakeGpu``) are mutable and can
change after a number of memory polls, so the polling in gpu_free is exercised.

Faithful where the code under test could go wrong:
- the v1 memory call counts the driver's reservation as used (as real NVML does) and has no
  ``reserved`` field; only ``nvmlDeviceGetMemoryInfo(h, version=nvmlMemory_v2)`` gives the
  v2 numbers;
- ECC counts, temperatures and thresholds answer per constant, so passing the wrong
  constant gives a different (wrong) number instead of the expected one;
- an unsupported query raises ``NVMLError`` whose text is "Not Supported"; any query can be
  made to fail with another NVML error (``errors``), e.g. "GPU is lost".
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIB = 1024 * 1024


class NVMLError(Exception):
    """pynvml's error: carries an NVML return code; ``str()`` is NVML's text for it."""

    _text = {
        1: "Uninitialized",
        2: "Invalid Argument",
        3: "Not Supported",
        9: "Driver Not Loaded",
        12: "NVML Shared Library Not Found",
        13: "Function Not Found",
        15: "GPU is lost",
    }

    def __init__(self, value):
        super().__init__(value)
        self.value = value

    def __str__(self):
        return self._text.get(self.value, "Unknown Error")


@dataclass
class FakeProcess:
    """What pynvml's running-process queries return per process."""

    pid: int
    usedGpuMemory: int | None  # bytes; None when the driver does not know  # noqa: N815 - pynvml's name


@dataclass
class MemoryV1:
    """c_nvmlMemory_t: used includes the driver's reservation, and there is no reserved field."""

    total: int
    free: int
    used: int


@dataclass
class MemoryV2:
    """c_nvmlMemory_v2_t."""

    version: int
    total: int
    reserved: int
    free: int
    used: int


@dataclass
class FakeGpu:
    """One GPU's state, in MiB; edit it (or give ``changes``) to make it change over time.

    ``changes`` maps a memory-read number (1 = the first memory query of this GPU) to the
    attributes set just before that read answers, e.g. ``{3: {"used_mib": 0, "compute": []}}``
    frees the GPU on the third poll.
    """

    name: str = "NVIDIA H200"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    minor: int = 0
    total_mib: int = 143771
    used_mib: int = 0
    reserved_mib: int = 615
    compute: list = field(default_factory=list)  # [(pid, used MiB or None)]
    graphics: list = field(default_factory=list)
    ecc_volatile_uncorrected: int = 0
    ecc_volatile_corrected: int = 7
    ecc_aggregate_uncorrected: int = 11
    remapped: tuple = (0, 0, 0, 0)  # (corrected rows, uncorrected rows, pending, failure)
    temperature_c: int = 31
    slowdown_c: int = 87
    shutdown_c: int = 92
    persistence: int = 1
    unsupported: set = field(default_factory=set)  # names of pynvml functions that fail "Not Supported"
    errors: dict = field(default_factory=dict)  # pynvml function name -> NVML error code it fails with
    changes: dict = field(default_factory=dict)
    memory_reads: int = 0
    # As the driver does: a compute process's memory is freed when the process is gone (or a zombie).
    freed_on_exit: bool = False

    def reap(self) -> None:
        if not self.freed_on_exit:
            return
        alive = [(pid, mib) for pid, mib in self.compute if _alive(pid)]
        self.used_mib -= sum(mib or 0 for pid, mib in self.compute if (pid, mib) not in alive)
        self.compute = alive


def _alive(pid: int) -> bool:
    try:
        with open("/proc/%d/stat" % pid) as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X", "x")
    except OSError:
        return False


class FakeHandle:
    """An opaque device handle, as pynvml's c_nvmlDevice_t is to callers."""

    def __init__(self, index):
        self.index = index


class FakeNvml:
    """Module-like stand-in for pynvml over a list of FakeGpu."""

    NVMLError = NVMLError
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_DRIVER_NOT_LOADED = 9
    NVML_ERROR_FUNCTION_NOT_FOUND = 13
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_TEMPERATURE_GPU = 0
    NVML_TEMPERATURE_THRESHOLD_SHUTDOWN = 0
    NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
    NVML_VOLATILE_ECC = 0
    NVML_AGGREGATE_ECC = 1
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    nvmlMemory_v2 = 0x02000028

    def __init__(self, gpus=None, driver="570.124.06", init_error=None, v2_memory=True):
        self.gpus = list(gpus or [])
        self.driver = driver
        self.init_error = init_error  # an NVML return code nvmlInit fails with
        self.v2_memory = v2_memory  # False: a driver older than nvmlDeviceGetMemoryInfo_v2
        self.initialised = 0  # nvmlInit calls minus nvmlShutdown calls

    # -- library --------------------------------------------------------------------------
    def nvmlInit(self):
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self):
        if self.initialised <= 0:
            raise NVMLError(1)
        self.initialised -= 1

    def nvmlSystemGetDriverVersion(self):
        self._check_init()
        return self.driver

    def nvmlDeviceGetCount(self):
        self._check_init()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._check_init()
        if not 0 <= index < len(self.gpus):
            raise NVMLError(2)
        if "nvmlDeviceGetHandleByIndex" in self.gpus[index].errors:
            raise NVMLError(self.gpus[index].errors["nvmlDeviceGetHandleByIndex"])
        return FakeHandle(index)

    # -- per device -----------------------------------------------------------------------
    def _gpu(self, handle, fn):
        self._check_init()
        gpu = self.gpus[handle.index]
        if fn in gpu.unsupported:
            raise NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        if fn in gpu.errors:
            raise NVMLError(gpu.errors[fn])
        return gpu

    def _check_init(self):
        if self.initialised <= 0:
            raise NVMLError(1)

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        gpu = self._gpu(handle, "nvmlDeviceGetMemoryInfo")
        if version and not self.v2_memory:
            raise NVMLError(self.NVML_ERROR_FUNCTION_NOT_FOUND)
        gpu.memory_reads += 1
        for name, value in gpu.changes.get(gpu.memory_reads, {}).items():
            setattr(gpu, name, value)
        gpu.reap()
        total, used, reserved = gpu.total_mib * MIB, gpu.used_mib * MIB, gpu.reserved_mib * MIB
        if not version:
            return MemoryV1(total=total, free=total - used - reserved, used=used + reserved)
        return MemoryV2(version=version, total=total, reserved=reserved, free=total - used - reserved, used=used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        gpu = self._gpu(handle, "nvmlDeviceGetComputeRunningProcesses")
        gpu.reap()
        return [FakeProcess(pid, None if mib is None else mib * MIB) for pid, mib in gpu.compute]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle):
        gpu = self._gpu(handle, "nvmlDeviceGetGraphicsRunningProcesses")
        return [FakeProcess(pid, None if mib is None else mib * MIB) for pid, mib in gpu.graphics]

    def nvmlDeviceGetTotalEccErrors(self, handle, error_type, counter_type):
        gpu = self._gpu(handle, "nvmlDeviceGetTotalEccErrors")
        counts = {
            (self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, self.NVML_VOLATILE_ECC): gpu.ecc_volatile_uncorrected,
            (self.NVML_MEMORY_ERROR_TYPE_CORRECTED, self.NVML_VOLATILE_ECC): gpu.ecc_volatile_corrected,
            (self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, self.NVML_AGGREGATE_ECC): gpu.ecc_aggregate_uncorrected,
        }
        return counts.get((error_type, counter_type), 0)

    def nvmlDeviceGetRemappedRows(self, handle):
        return tuple(self._gpu(handle, "nvmlDeviceGetRemappedRows").remapped)

    def nvmlDeviceGetTemperature(self, handle, sensor):
        gpu = self._gpu(handle, "nvmlDeviceGetTemperature")
        if sensor != self.NVML_TEMPERATURE_GPU:
            raise NVMLError(2)
        return gpu.temperature_c

    def nvmlDeviceGetTemperatureThreshold(self, handle, threshold):
        gpu = self._gpu(handle, "nvmlDeviceGetTemperatureThreshold")
        return {
            self.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: gpu.slowdown_c,
            self.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: gpu.shutdown_c,
        }[threshold]

    def nvmlDeviceGetPersistenceMode(self, handle):
        return self._gpu(handle, "nvmlDeviceGetPersistenceMode").persistence

    def nvmlDeviceGetName(self, handle):
        return self._gpu(handle, "nvmlDeviceGetName").name

    def nvmlDeviceGetUUID(self, handle):
        return self._gpu(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetMinorNumber(self, handle):
        return self._gpu(handle, "nvmlDeviceGetMinorNumber").minor
