"""sglang_server on a real GPU: the role starts the reference engine on CUDA with a ~1B model
built locally (random weights), verifies and probes it, stops it, and gpu_reset proves the GPU free."""

from __future__ import annotations

import json
import urllib.request

import pytest
from harness import build_random_llama, nvml_used_mib, pid_alive, run_named_playbook

pytestmark = [pytest.mark.gpu, pytest.mark.idle_gpu]


def test_role_serves_on_cuda_probes_then_stops_and_frees_the_gpu(tmp_path_factory):
    work = tmp_path_factory.mktemp("sglang_server")
    model = build_random_llama(work / "llama-1b")
    port = 30211
    common = {
        "sglang_server_model_path": str(model),
        "sglang_server_build_tiny_model": False,
        "sglang_server_device": "cuda",
        "sglang_server_port": port,
        "sglang_server_state_dir": str(work / "servers"),
        "sglang_server_capture_dir": str(work / "capture"),
        "sglang_server_ready_timeout_s": 300,
        "gpu_reset_required": True,
        "gpu_reset_match": ["serve-reference"],
        "gpu_reset_timeout_s": 30,
    }
    rc, out, seconds = run_named_playbook("sglang_server", common)
    print(out[-3000:], f"\nstart: {seconds:.1f} s")
    assert rc == 0, out[-3000:]
    info = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=10).read())
    assert info["device"].startswith("cuda") and info["dtype"] == "bfloat16"
    assert info["disable_radix_cache"] is True and info["chunked_prefill_size"] == -1
    used = nvml_used_mib()[0]
    print("NVML while serving:", json.dumps(used))
    assert used["v2_used_mib"] > 2000  # ~2.2 GB of bf16 weights
    state = json.loads((work / "servers" / f"eagle3-reference-{port}.json").read_text())

    rc, out, _ = run_named_playbook("sglang_server", common)
    assert rc == 0 and "changed=0" in out, out[-2000:]

    rc, out, seconds = run_named_playbook("sglang_server", {**common, "sglang_server_state": "stopped"})
    print(out[-3000:], f"\nstop: {seconds:.1f} s")
    assert rc == 0, out[-3000:]
    assert not pid_alive(state["pid"])
    after = nvml_used_mib()[0]
    print("NVML after stop:", json.dumps(after))
    assert after["v2_used_mib"] == 0 and not after["compute_pids"]
