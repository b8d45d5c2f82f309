"""Shared by tests/gpu and bench/: start tagged GPU holders, run the playbook, read NVML.

Every process started here carries a unique tag in its command line, and only tagged
processes are ever aimed at (gpu_reset_match), so the shared GPU machine's own processes are
never touched.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOLDER = Path(__file__).with_name("cuda_holder.py")


def new_tag(prefix: str = "e3p-gpu") -> str:
    """A tag no other process on the machine carries."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@dataclass
class Holders:
    """Tagged holder processes started for one test or benchmark round."""

    tag: str
    workdir: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)

    def start(self, name: str, mode: str, mib: int = 1024, children: int = 2, tag: str | None = None) -> None:
        """Start one holder in its own session (as a service manager would)."""
        ready = self.workdir / f"{name}.ready"
        cmd = [sys.executable, str(HOLDER), "--tag", tag or self.tag, "--mode", mode, "--mib", str(mib),
               "--children", str(children), "--ready", str(ready)]
        self.procs[name] = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL)

    def wait_ready(self, timeout_s: float = 180) -> None:
        """Poll until every holder wrote its ready file; fail if one died."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"holder {name} exited early with {proc.returncode}")
            if all((self.workdir / f"{n}.ready").exists() for n in self.procs):
                self.pids = {n: int((self.workdir / f"{n}.ready").read_text()) for n in self.procs}
                for n in self.procs:
                    for child in sorted(self.workdir.glob(f"{n}.child[0-9]")):
                        self.pids[f"{n}/{child.suffix[1:]}"] = int(child.read_text())
                return
            time.sleep(0.05)
        raise TimeoutError("holders not ready")

    def alive(self) -> dict[str, bool]:
        """Which holders still run (a zombie counts as gone)."""
        return {name: pid_alive(pid) for name, pid in self.pids.items()}

    def kill_all(self) -> None:
        """SIGKILL every process this object started (whole sessions), and reap them."""
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in self.pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs.values():
            proc.wait(timeout=30)


def pid_alive(pid: int) -> bool:
    """True when the PID runs and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def nvml_used_mib() -> list[dict]:
    """Per GPU: v1 used, v2 used and reserved MiB, and compute PIDs, read straight from NVML."""
    import pynvml  # noqa: PLC0415

    pynvml.nvmlInit()
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            v1 = pynvml.nvmlDeviceGetMemoryInfo(h)
            v2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
            pids = [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
            out.append({"index": i, "v1_used_mib": v1.used >> 20, "v2_used_mib": v2.used >> 20,
                        "v2_reserved_mib": v2.reserved >> 20, "compute_pids": pids})
        return out
    finally:
        pynvml.nvmlShutdown()


def run_playbook(extravars: dict, check: bool = False, timeout_s: float = 300) -> tuple[int, str, float]:
    """Run playbooks/gpu_reset.yml on localhost with ansible-playbook; return (rc, output, seconds)."""
    return run_named_playbook("gpu_reset", extravars, check=check, timeout_s=timeout_s)


def build_random_llama(path: Path, hidden: int = 2048, layers: int = 16, heads: int = 32, kv_heads: int = 8,
                       intermediate: int = 5632, vocab: int = 32000) -> Path:
    """A Llama of about 1.1B parameters (the defaults) with random weights, in bf16, built locally.

    No tokenizer: the reference engine then takes input_ids only, which is all these runs send.
    """
    import torch  # noqa: PLC0415
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    if (path / "config.json").exists():
        return path
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=vocab,
                         max_position_embeddings=4096, tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(0)
    # On the CPU: a CUDA context here would make the calling test process a GPU holder itself.
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tmp.rename(path)
    return path


def run_named_playbook(
    name: str, extravars: dict, check: bool = False, timeout_s: float = 600
) -> tuple[int, str, float]:
    """Run playbooks/<name>.yml on localhost with ansible-playbook; return (rc, output, seconds)."""
    cmd = ["ansible-playbook", "-i", str(ROOT / "inventory" / "local.yml"), str(ROOT / "playbooks" / f"{name}.yml"),
           "-e", json.dumps(extravars)]
    if check:
        cmd.append("--check")
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s, check=False)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - start
