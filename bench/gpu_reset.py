"""Benchmark: gpu_reset's playbook against the seeds' by-hand reset, side by side, on a GPU.

Each round starts the same tagged holder set twice: two plain CUDA holders, a launcher whose
two children hold the GPU, and a protected device-file holder (as nvidia-persistenced or a
DCGM exporter would be). One copy is freed by playbooks/gpu_reset.yml, the other by the
seeds' sequence -- pkill -f; pkill -9 -f; fuser -k on the device files; sleep 5; sleep 3;
nvidia-smi -- aimed at the tagged processes only, since the machine is shared.

Printed per round: seconds from the first signal to verified free (for the role, the
modules' own timings; for the seeds, until nvidia-smi has answered), the playbook's wall
time, and which processes each approach killed. Then the playbook's wall time with nothing
holding the GPUs. Run on the GPU machine: python3 bench/gpu_reset.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))

from harness import Holders, new_tag, nvml_used_mib, run_playbook  # noqa: E402


def start_set(holders: Holders, with_stubborn: bool) -> None:
    """The benchmark's holder set."""
    holders.start("plain1", "plain", mib=4096)
    holders.start("plain2", "plain", mib=4096)
    holders.start("launcher", "launcher", mib=2048, children=2)
    holders.start("protected", "device-only", tag=holders.tag + "-protected")
    if with_stubborn:
        holders.start("stubborn", "ignore-term", mib=2048)
    holders.wait_ready()


def tagged_pids(tag: str) -> list[int]:
    """PIDs whose command line carries the tag (what pkill -f would hit), never this process."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as handle:
                if tag.encode() in handle.read():
                    found.append(int(name))
        except OSError:
            continue
    return found


def device_holders_tagged(tag: str) -> list[int]:
    """What `fuser -k /dev/nvidia*` would kill, restricted to the tagged processes."""
    devices = {os.path.realpath(p) for p in Path("/dev").glob("nvidia*")}
    hits = []
    for pid in tagged_pids(tag):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in devices:
                    hits.append(pid)
                    break
            except OSError:
                continue
    return hits


def signal_all(pids: list[int], sig: int) -> None:
    """Send a signal to each PID, ignoring those already gone."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def seeds_sequence(tag: str) -> float:
    """The seeds' reset aimed at the tag; seconds from the first signal until nvidia-smi answered."""
    start = time.monotonic()
    signal_all(tagged_pids(tag), signal.SIGTERM)  # pkill -f sglang.launch_server
    signal_all(tagged_pids(tag), signal.SIGKILL)  # pkill -9 -f sglang; pkill -9 python3
    signal_all(device_holders_tagged(tag), signal.SIGKILL)  # fuser -k /dev/nvidia*
    time.sleep(5)  # sleep 5
    time.sleep(3)  # ssh ... "sleep 3; nvidia-smi ..."
    subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader"],
                   check=True, capture_output=True)
    return time.monotonic() - start


def run_round(workdir: Path, with_stubborn: bool, grace_s: float) -> dict:
    """One side-by-side round."""
    row = {}
    role = Holders(tag=new_tag("e3p-bench"), workdir=workdir / "role")
    role.workdir.mkdir(parents=True)
    try:
        start_set(role, with_stubborn)
        extravars = {
            "gpu_reset_required": True,
            "gpu_reset_match": [role.tag],
            "gpu_reset_protect_extra": [role.tag + "-protected"],
            "gpu_reset_grace_s": grace_s,
            "gpu_reset_report_dir": str(role.workdir / "report"),
        }
        rc, out, wall = run_playbook(extravars)
        if rc != 0:
            raise RuntimeError(out[-3000:])
        report = json.loads((role.workdir / "report" / "localhost.json").read_text())
        row["role_first_signal_to_free_s"] = report["seconds_to_free"]
        row["role_playbook_wall_s"] = round(wall, 2)
        row["role_killed"] = sorted(n for n, alive in role.alive().items() if not alive)
        row["role_signals"] = sorted({r["signal"] for r in report["stopped"]})
        row["role_used_after_mib"] = [g["v2_used_mib"] for g in nvml_used_mib()]
    finally:
        role.kill_all()

    seeds = Holders(tag=new_tag("e3p-bench"), workdir=workdir / "seeds")
    seeds.workdir.mkdir(parents=True)
    try:
        start_set(seeds, with_stubborn)
        row["seeds_first_signal_to_free_s"] = round(seeds_sequence(seeds.tag), 2)
        row["seeds_killed"] = sorted(n for n, alive in seeds.alive().items() if not alive)
        row["seeds_used_after_mib"] = [g["v2_used_mib"] for g in nvml_used_mib()]
    finally:
        seeds.kill_all()
    row["speedup"] = round(row["seeds_first_signal_to_free_s"] / row["role_first_signal_to_free_s"], 1)
    return row


def main() -> None:
    """Run the rounds and print the table and the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stubborn-grace-s", type=float, default=2.0,
                        help="grace for the extra round with a SIGTERM-ignoring holder")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="e3p-bench-") as tmp:
        for i in range(args.rounds):
            rows.append({"round": i + 1, "set": "well-behaved", **run_round(Path(tmp) / f"r{i}", False, 10.0)})
            print(json.dumps(rows[-1]), flush=True)
        rows.append({"round": "extra", "set": f"with SIGTERM-ignorer, grace {args.stubborn_grace_s} s",
                     **run_round(Path(tmp) / "stubborn", True, args.stubborn_grace_s)})
        print(json.dumps(rows[-1]), flush=True)
        idle = []
        for _ in range(3):
            rc, out, wall = run_playbook({"gpu_reset_required": True, "gpu_reset_match": [new_tag("e3p-none")]})
            if rc != 0:
                raise RuntimeError(out[-3000:])
            idle.append(wall)
    well = [r for r in rows if r["set"] == "well-behaved"]
    print()
    print("| round | set | role: first signal -> verified free (s) | role playbook wall (s) | "
          "seeds: first signal -> nvidia-smi (s) | speedup | role killed | seeds killed |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['round']} | {r['set']} | {r['role_first_signal_to_free_s']} | {r['role_playbook_wall_s']} | "
              f"{r['seeds_first_signal_to_free_s']} | {r['speedup']}x | {', '.join(r['role_killed'])} | "
              f"{', '.join(r['seeds_killed'])} |")
    print()
    print(f"median speedup (well-behaved set): {statistics.median(r['speedup'] for r in well)}x")
    print(f"protected holder killed by the role: {any('protected' in r['role_killed'] for r in rows)}; "
          f"by the seeds' sequence: {all('protected' in r['seeds_killed'] for r in rows)}")
    print(f"playbook wall time with nothing holding the GPUs: median {statistics.median(idle):.2f} s "
          f"({', '.join(f'{x:.2f}' for x in idle)})")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "idle_wall_s": idle}, indent=2))


if __name__ == "__main__":
    main()
