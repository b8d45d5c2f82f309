"""gpu_reset on a real GPU: real CUDA processes hold memory; the playbook must free it.

Only processes these tests start are aimed at (gpu_reset_match on a unique tag).
"""

from __future__ import annotations

import json
import signal

import pytest
from harness import nvml_used_mib, pid_alive, run_playbook

pytestmark = [pytest.mark.gpu, pytest.mark.idle_gpu]


def base_vars(holders, tmp_path, **extra):
    """Extravars aiming the role at this test's processes only."""
    return {
        "gpu_reset_required": True,
        "gpu_reset_match": [holders.tag],
        "gpu_reset_protect_extra": [holders.tag + "-protected"],
        "gpu_reset_grace_s": 2,
        "gpu_reset_timeout_s": 20,
        "gpu_reset_report_dir": str(tmp_path / "report"),
        **extra,
    }


def test_idle_gpu_reports_zero_used_with_v2_while_v1_counts_the_reservation():
    state = nvml_used_mib()
    print("NVML idle:", json.dumps(state))
    for gpu in state:
        assert gpu["compute_pids"] == [], f"GPU {gpu['index']} is not idle at test start: {gpu}"
        assert gpu["v2_used_mib"] == 0
        assert gpu["v1_used_mib"] >= gpu["v2_reserved_mib"] > 0


def test_playbook_stops_holders_frees_memory_and_spares_protected(holders, tmp_path):
    holders.start("plain", "plain", mib=2048)
    holders.start("launcher", "launcher", mib=1024, children=2)
    holders.start("stubborn", "ignore-term", mib=1024)
    holders.start("protected", "device-only", tag=holders.tag + "-protected")
    holders.wait_ready()
    held = nvml_used_mib()
    print("NVML with holders:", json.dumps(held))
    assert held[0]["v2_used_mib"] >= 4096

    rc, out, seconds = run_playbook(base_vars(holders, tmp_path))
    print(out[-4000:])
    assert rc == 0, out[-3000:]
    after = nvml_used_mib()
    print("NVML after:", json.dumps(after), f"playbook {seconds:.1f} s")
    assert all(g["v2_used_mib"] == 0 and not g["compute_pids"] for g in after)

    alive = holders.alive()
    assert alive.pop("protected") is True
    assert not any(alive.values()), alive

    report = json.loads((tmp_path / "report" / "localhost.json").read_text())
    by_pid = {r["pid"]: r for r in report["stopped"]}
    assert by_pid[holders.pids["plain"]]["signal"] == "SIGTERM"
    assert by_pid[holders.pids["stubborn"]]["signal"] == "SIGKILL"
    for name in ("launcher", "launcher/child0", "launcher/child1"):
        assert by_pid[holders.pids[name]]["unit"] == f"group {holders.pids['launcher']}"
    ours = set(holders.pids.values())
    left_ours = [r for r in report["left"] if r["pid"] in ours]
    assert [r["pid"] for r in left_ours] == [holders.pids["protected"]]
    assert left_ours[0]["reason"].startswith("protected: matches")
    print("left alone:", json.dumps(report["left"]))
    assert report["seconds_to_free"] is not None
    print("first signal to verified free:", report["seconds_to_free"], "s")

    rc, out, _ = run_playbook(base_vars(holders, tmp_path))
    assert rc == 0
    assert "changed=0" in out, out[-2000:]


def test_protected_holder_of_memory_fails_the_play_naming_it(holders, tmp_path):
    holders.start("protected", "plain", mib=1024, tag=holders.tag + "-protected")
    holders.wait_ready()
    rc, out, _ = run_playbook(base_vars(holders, tmp_path, gpu_reset_timeout_s=2))
    print(out[-3000:])
    assert rc != 0
    pid = holders.pids["protected"]
    assert f"PID {pid}" in out
    assert "protected: matches" in out
    assert "GPU 0 holds" in out
    assert pid_alive(pid)


def test_check_mode_signals_nothing(holders, tmp_path):
    holders.start("plain", "plain", mib=512)
    holders.wait_ready()
    rc, out, _ = run_playbook(base_vars(holders, tmp_path), check=True)
    assert rc == 0, out[-3000:]
    assert f"would stop PID {holders.pids['plain']}" in out
    assert pid_alive(holders.pids["plain"])
    assert nvml_used_mib()[0]["v2_used_mib"] >= 512


def test_unmatched_holder_is_left_and_explained(holders, tmp_path):
    holders.start("other", "plain", mib=512, tag=holders.tag + "-other")
    holders.wait_ready()
    vars_ = base_vars(holders, tmp_path, gpu_reset_match=[holders.tag + "$"], gpu_reset_timeout_s=1)
    rc, out, _ = run_playbook(vars_)
    assert rc != 0
    assert "not matched by any pattern of gpu_reset_match" in out
    assert pid_alive(holders.pids["other"])
    holders.procs["other"].send_signal(signal.SIGKILL)
