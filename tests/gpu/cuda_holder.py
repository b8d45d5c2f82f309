"""A process that holds an NVIDIA GPU the way real workloads do, for GPU tests and benchmarks.

Modes:
  plain        allocates --mib MiB with torch on the GPU, then waits (SIGTERM ends it)
  ignore-term  the same, but ignores SIGTERM (only SIGKILL ends it)
  launcher     holds nothing itself; starts --children plain holders in its own process
               group, like an inference server whose scheduler children hold the GPU
  device-only  opens the NVIDIA device files without a CUDA context (like nvidia-persistenced
               or a monitoring daemon): a device-file holder that uses no GPU memory
Every mode writes its PID to --ready once it holds the GPU; ``--tag`` only marks the command
line, so tests and benchmarks can aim at their own processes and nothing else.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def wait_files(paths: list[Path], timeout_s: float) -> None:
    """Poll until every path exists; raise TimeoutError naming the missing ones."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(p.exists() for p in paths):
            return
        time.sleep(0.05)
    missing = [str(p) for p in paths if not p.exists()]
    raise TimeoutError(f"holders not ready after {timeout_s} s: {missing}")


def hold_gpu(mib: int, device: int) -> object:
    """Allocate ``mib`` MiB on the GPU and make sure the allocation happened."""
    import torch  # noqa: PLC0415 - only the CUDA modes need it

    block = torch.empty(mib * 1024 * 1024, dtype=torch.uint8, device=f"cuda:{device}")
    block.fill_(1)
    torch.cuda.synchronize(device)
    return block


def main() -> None:
    """Parse the mode, take the GPU, signal readiness, wait to be stopped."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--tag", required=True)
    parser.add_argument("--mode", choices=["plain", "ignore-term", "launcher", "device-only"], default="plain")
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--children", type=int, default=2)
    parser.add_argument("--ready", type=Path, required=True)
    args = parser.parse_args()

    keep = None
    if args.mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.mode in ("plain", "ignore-term"):
        keep = hold_gpu(args.mib, args.device)
    elif args.mode == "device-only":
        keep = [os.open(p, os.O_RDWR) for p in (f"/dev/nvidia{args.device}", "/dev/nvidiactl") if os.path.exists(p)]
    else:  # launcher: children stay in this process group
        ready = [args.ready.with_suffix(f".child{i}") for i in range(args.children)]
        keep = [
            subprocess.Popen(
                [sys.executable, __file__, "--tag", args.tag, "--mode", "plain", "--mib", str(args.mib),
                 "--device", str(args.device), "--ready", str(path)]
            )
            for path in ready
        ]
        wait_files(ready, 120)
    tmp = args.ready.with_name(args.ready.name + ".tmp")
    tmp.write_text(str(os.getpid()))
    tmp.rename(args.ready)
    while keep is not None:
        signal.pause()


if __name__ == "__main__":
    main()
