#!/usr/bin/python
"""Ansible module gpu_info: read-only facts about a host's NVIDIA GPUs from NVML."""

from __future__ import absolute_import, division, print_function

DOCUMENTATION = r"""
---
module: gpu_info
short_description: Report a host's NVIDIA GPUs, their memory, processes and health from NVML
description:
  - Reads NVML through the nvidia-ml-py package (C(pynvml)) and reports, per GPU, its index,
    UUID, name, memory total / used / reserved, the processes on it with their command lines,
    temperature, volatile uncorrected ECC errors, remapped rows and persistence mode, plus the
    driver version.
  - Used memory comes from the v2 memory call, which leaves out the memory the driver reserves
    for itself (about 615 MiB on an idle H200 is "used" by the v1 call and 0 by v2).
  - Never changes anything. With no NVIDIA driver or no pynvml it reports
    C(nvml_available=false) and the reason, or fails when O(required=true).
options:
  gpus:
    description: V(all), or a list of GPU indices to report.
    type: raw
    default: all
  required:
    description: Fail when NVML cannot be used, instead of reporting C(nvml_available=false).
    type: bool
    default: false
  max_temperature_c:
    description:
      - Temperature at or above which a GPU is reported in RV(health_problems).
      - When unset, each GPU's own slowdown threshold from NVML is used.
    type: int
  check_ecc:
    description: Report volatile uncorrected ECC errors in RV(health_problems).
    type: bool
    default: true
  check_remapped_rows:
    description: Report pending or failed row remapping in RV(health_problems).
    type: bool
    default: true
notes:
  - Supports check mode; it changes nothing in either mode.
requirements:
  - nvidia-ml-py on the managed host (the gpu_reset role can provide it in a venv).
author:
  - eagle3-pipeline developers
"""

EXAMPLES = r"""
- name: Read the GPUs of this host
  gpu_info:
  register: gpus

- name: Fail unless NVML works, checking GPUs 0 and 1 against 85 C
  gpu_info:
    gpus: [0, 1]
    required: true
    max_temperature_c: 85
"""

RETURN = r"""
nvml_available:
  description: Whether NVML could be used.
  returned: always
  type: bool
reason:
  description: Why NVML could not be used (and what to do).
  returned: when nvml_available is false
  type: str
driver_detected:
  description: Whether the host shows an NVIDIA kernel driver (/proc/driver/nvidia or /dev/nvidiactl).
  returned: always
  type: bool
python:
  description: The Python interpreter the module ran with (the one that needs pynvml).
  returned: always
  type: str
driver_version:
  description: NVIDIA driver version.
  returned: when nvml_available
  type: str
gpu_count:
  description: Number of GPUs NVML sees on the host.
  returned: when nvml_available
  type: int
gpus:
  description: One entry per selected GPU.
  returned: always
  type: list
  elements: dict
  sample:
    - index: 0
      uuid: GPU-5f1c...
      name: NVIDIA H200
      minor_number: 0
      memory_total_mib: 143771
      memory_used_mib: 0
      memory_reserved_mib: 615
      processes: [{pid: 4242, used_mib: 70000, kind: compute, cmdline: "python -m sglang.launch_server ..."}]
      temperature_c: 31
      temperature_slowdown_c: 87
      ecc_volatile_uncorrected: 0
      remapped_rows_pending: false
      remapped_rows_failed: false
      remapped_rows_uncorrectable: 0
      persistence_mode: true
health_problems:
  description: Health problems found, one sentence each naming the GPU and the remedy.
  returned: always
  type: list
  elements: str
"""

import sys

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.gpu_holders import read_proc
from ansible.module_utils.gpu_nvml import (
    NVML_FAILURE_REMEDY,
    NvmlUnavailable,
    device_count,
    driver_detected,
    driver_version,
    health_problems,
    load_nvml,
    read_gpu,
    select_indices,
)


def main():
    """Map options to NVML reads and the results to JSON."""
    module = AnsibleModule(
        argument_spec=dict(
            gpus=dict(type="raw", default="all"),
            required=dict(type="bool", default=False),
            max_temperature_c=dict(type="int"),
            check_ecc=dict(type="bool", default=True),
            check_remapped_rows=dict(type="bool", default=True),
        ),
        supports_check_mode=True,
    )
    params = module.params
    result = dict(
        changed=False,
        python=sys.executable,
        driver_detected=driver_detected(),
        gpus=[],
        health_problems=[],
    )
    if params["max_temperature_c"] is not None and params["max_temperature_c"] <= 0:
        module.fail_json(
            msg="max_temperature_c must be a positive number of degrees C, got %d" % params["max_temperature_c"], **result
        )
    try:
        nvml = load_nvml()
    except NvmlUnavailable as exc:
        result.update(nvml_available=False, reason=str(exc))
        if params["required"]:
            module.fail_json(msg="NVML is required but unavailable on this host: %s" % exc, **result)
        module.exit_json(**result)
    index = None
    try:
        count = device_count(nvml)
        try:
            indices = select_indices(params["gpus"], count)
        except ValueError as exc:
            module.fail_json(msg=str(exc), nvml_available=True, gpu_count=count, **result)
        gpus = []
        for index in indices:
            gpu = read_gpu(nvml, index)
            for proc in gpu["processes"]:
                info = read_proc(proc["pid"])
                proc["cmdline"] = info.display if info else None
            gpus.append(gpu)
            result["health_problems"].extend(
                health_problems(
                    gpu,
                    max_temperature_c=params["max_temperature_c"],
                    check_ecc=params["check_ecc"],
                    check_remapped_rows=params["check_remapped_rows"],
                )
            )
        result.update(nvml_available=True, driver_version=driver_version(nvml), gpu_count=count, gpus=gpus)
    except nvml.NVMLError as exc:
        where = "" if index is None else "GPU %d: " % index
        module.fail_json(msg="%sNVML query failed: %s; %s" % (where, exc, NVML_FAILURE_REMEDY), nvml_available=True, **result)
    finally:
        nvml.nvmlShutdown()
    module.exit_json(**result)


if __name__ == "__main__":
    main()
