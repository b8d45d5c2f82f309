"""Fresh Debian hosts booted with systemd and reached over SSH: the operator's path, for the tests.

``up`` builds a Debian root filesystem with mmdebstrap (once: it is cached under
``.cache/remote-hosts/`` by a hash of its recipe), copies it for each host, gives each host its own
SSH host keys, a user with sudo and a password, the test's SSH key and a static address on a bridge
that this script creates, then boots each with ``systemd-nspawn -b`` (systemd as PID 1) and waits
until ``systemctl is-system-running`` answers ``running`` over SSH. One directory of the work dir is
bind-mounted into every host at the same path, as a shared filesystem (NFS, Lustre, ...) would be.
The hosts have no route beyond the bridge: like many GPU clusters, they reach no package registry.

``index`` serves a wheelhouse (``eagle3-pipeline wheelhouse``) to the hosts as a PEP 503 simple
index on the bridge, as a site's own mirror would (``python -m http.server`` over ``simple/<project>/``,
each request logged with the address that asked): the install without a wheelhouse, through
``eagle3_pip_extra_args``, has an index to reach.

``down`` powers them off, stops the index and removes what ``up`` made (the cached root filesystem
stays). ``up`` runs ``down`` first, so a run that was killed half-way leaves nothing that stops the next one.

The work dir then holds what an operator's controller would hold: ``ssh_config`` (an alias per
host, as operators name their hosts: the alias resolves nowhere but in this file), the key, the
hosts' keys in ``known_hosts`` (strict checking stays on) and the sudo password in a file of mode
0600. ``molecule/remote`` and ``tests/integration/test_remote_hosts.py`` use it.

    python3 tests/remote_hosts.py up [--count 2] [--work DIR]
    python3 tests/remote_hosts.py index --wheelhouse DIR [--work DIR]
    python3 tests/remote_hosts.py down [--work DIR]

Needs root, mmdebstrap and systemd-container (``make remote-host-tools`` installs them).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "remote-hosts"
DEFAULT_WORK = CACHE / "run"

# The recipe of the root filesystem; any change to it builds (and caches) a new one.
SUITE = "bookworm"
VARIANT = "minbase"
PACKAGES = ("systemd", "systemd-sysv", "dbus", "openssh-server", "python3", "python3-venv", "sudo", "iproute2")
RECIPE_VERSION = 1  # raise when the steps below change what the cached filesystem holds

BRIDGE = "e3rbr0"
SUBNET = "10.213.7"  # the bridge is .1, host N is .(10 + N): a private range on a bridge of this script's own
USER = "ops"
SHARED_MOUNT = "/srv/eagle3-shared"
BOOT_TIMEOUT_S = 120
INDEX_PORT = 8141  # the package index, on the bridge's address


def recipe_hash() -> str:
    """A short hash of everything that decides the cached root filesystem's contents."""
    recipe = {"suite": SUITE, "variant": VARIANT, "packages": sorted(PACKAGES), "version": RECIPE_VERSION}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def host_name(index: int) -> str:
    """The inventory name of host ``index`` (1-based)."""
    return f"remote-{index}"


def host_alias(index: int) -> str:
    """The SSH alias of host ``index``: what ``ansible_host`` holds; only ssh_config resolves it."""
    return f"e3-remote-{index}"


def host_address(index: int) -> str:
    """The host's address on the bridge."""
    return f"{SUBNET}.{10 + index}"


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run a command (argv, no shell), failing with its own output when it fails."""
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    result = subprocess.run(argv, check=False, **kwargs)
    if result.returncode != 0:
        output = (result.stderr or result.stdout or "").strip()
        raise RuntimeError(f"{' '.join(argv)} exited {result.returncode}: {output}")
    return result


def require_tools() -> None:
    """Fail with the fix when this machine cannot build or boot the hosts."""
    if os.geteuid() != 0:
        raise RuntimeError("the test hosts need root (mmdebstrap, systemd-nspawn, a bridge): run as root")
    missing = [tool for tool in ("mmdebstrap", "systemd-nspawn", "ip", "ssh", "ssh-keygen") if not shutil.which(tool)]
    if missing:
        raise RuntimeError(
            f"missing {', '.join(missing)}: install Debian's mmdebstrap, systemd-container, iproute2 and "
            "openssh-client (make remote-host-tools)"
        )


def cached_rootfs() -> Path:
    """The root filesystem for the recipe, built with mmdebstrap the first time (about a minute)."""
    target = CACHE / f"rootfs-{recipe_hash()}"
    if (target / "etc" / "os-release").exists():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    partial = CACHE / f".rootfs-{recipe_hash()}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    run(["mmdebstrap", f"--variant={VARIANT}", f"--include={','.join(PACKAGES)}", SUITE, str(partial)])
    # Each host gets its own host keys at boot of the copy; none are shared through the cache.
    for key in (partial / "etc" / "ssh").glob("ssh_host_*"):
        key.unlink()
    partial.rename(target)
    return target


def configure_host(rootfs: Path, index: int, public_key: str, password: str) -> str:
    """Make a copied root filesystem host ``index``; returns its SSH host public key (ed25519)."""
    name = host_name(index)
    (rootfs / "etc" / "hostname").write_text(f"{name}\n")
    (rootfs / "etc" / "hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {name}\n::1 localhost ip6-localhost\n")
    network = rootfs / "etc" / "systemd" / "network"
    network.mkdir(parents=True, exist_ok=True)
    # Sorts before the image's own 80-container-host0.network, which would ask for DHCP.
    (network / "10-host0.network").write_text(
        f"[Match]\nName=host0\n\n[Network]\nAddress={host_address(index)}/24\nLinkLocalAddressing=no\n"
    )
    chroot = ["chroot", str(rootfs)]
    run([*chroot, "systemctl", "enable", "systemd-networkd", "ssh"])
    run([*chroot, "ssh-keygen", "-A"])
    run([*chroot, "useradd", "--create-home", "--shell", "/bin/bash", "--groups", "sudo", USER])
    run([*chroot, "chpasswd"], input=f"{USER}:{password}\n")
    ssh_dir = rootfs / "home" / USER / ".ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    (ssh_dir / "authorized_keys").write_text(public_key)
    run([*chroot, "chown", "-R", f"{USER}:{USER}", f"/home/{USER}/.ssh"])
    (rootfs / SHARED_MOUNT.lstrip("/")).mkdir(parents=True, exist_ok=True)
    return (rootfs / "etc" / "ssh" / "ssh_host_ed25519_key.pub").read_text().split()[:2]


def write_client_files(work: Path, count: int, host_keys: dict[int, list[str]]) -> None:
    """ssh_config (one alias per host) and known_hosts, as an operator's controller holds them."""
    lines = []
    for index in range(1, count + 1):
        lines += [
            f"Host {host_alias(index)}",
            f"  HostName {host_address(index)}",
            f"  User {USER}",
            f"  IdentityFile {work / 'id_ed25519'}",
            "  IdentitiesOnly yes",
            f"  UserKnownHostsFile {work / 'known_hosts'}",
            "  StrictHostKeyChecking yes",
            "  ConnectTimeout 5",
            "",
        ]
    (work / "ssh_config").write_text("\n".join(lines))
    (work / "known_hosts").write_text(
        "".join(f"{host_address(index)} {' '.join(key)}\n" for index, key in sorted(host_keys.items()))
    )


def ssh(work: Path, index: int, command: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    """Run a command on host ``index`` over SSH as the test user (no shell on this side)."""
    return subprocess.run(
        ["ssh", "-F", str(work / "ssh_config"), host_alias(index), "--", *command],
        capture_output=True, text=True, timeout=timeout, check=False,
    )


def wait_running(work: Path, index: int, log: Path) -> None:
    """Poll until systemd on the host says ``running`` over SSH; fail with the console's tail."""
    deadline = time.monotonic() + BOOT_TIMEOUT_S
    answer = ""
    while time.monotonic() < deadline:
        try:
            result = ssh(work, index, ["systemctl", "is-system-running"], timeout=10)
            answer = (result.stdout or result.stderr).strip()
        except subprocess.TimeoutExpired:
            answer = "ssh timed out"
        if answer == "running":
            return
        if answer == "degraded":
            failed = ssh(work, index, ["systemctl", "--failed", "--no-legend"]).stdout.strip()
            raise RuntimeError(f"{host_name(index)} booted degraded: {failed}")
        time.sleep(0.5)
    tail = log.read_text(errors="replace").splitlines()[-20:] if log.exists() else []
    raise RuntimeError(
        f"{host_name(index)} ({host_address(index)}) did not come up within {BOOT_TIMEOUT_S} s "
        f"(last answer: {answer!r}); console:\n" + "\n".join(tail)
    )


def up(work: Path = DEFAULT_WORK, count: int = 2) -> dict:
    """Build and boot ``count`` hosts; returns the state (also written to ``work/state.json``)."""
    require_tools()
    down(work)
    rootfs = cached_rootfs()
    work.mkdir(parents=True, exist_ok=True)
    (work / "shared").mkdir(exist_ok=True)
    key = work / "id_ed25519"
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "eagle3-remote-test", "-f", str(key)])
    password = secrets.token_urlsafe(12)
    secret = work / "become_password"
    secret.write_text(password)
    secret.chmod(0o600)
    run(["ip", "link", "add", BRIDGE, "type", "bridge"])
    run(["ip", "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE])
    run(["ip", "link", "set", BRIDGE, "up"])
    state = {"work": str(work), "bridge": BRIDGE, "shared": str(work / "shared"), "shared_mount": SHARED_MOUNT,
             "hosts": []}
    host_keys = {}
    for index in range(1, count + 1):
        host_root = work / "hosts" / host_name(index)
        host_root.parent.mkdir(parents=True, exist_ok=True)
        run(["cp", "-a", "--reflink=auto", str(rootfs), str(host_root)])
        host_keys[index] = configure_host(host_root, index, (work / "id_ed25519.pub").read_text(), password)
        log = work / f"{host_name(index)}.console.log"
        with open(log, "wb") as console:
            nspawn = subprocess.Popen(  # noqa: S603 - argv, no shell
                ["systemd-nspawn", "-D", str(host_root), "-M", host_alias(index), "-b", "--console=read-only",
                 f"--network-bridge={BRIDGE}", "--register=no", "--keep-unit",
                 f"--bind={work / 'shared'}:{SHARED_MOUNT}"],
                stdin=subprocess.DEVNULL, stdout=console, stderr=subprocess.STDOUT, start_new_session=True,
            )
        state["hosts"].append({"name": host_name(index), "alias": host_alias(index), "address": host_address(index),
                               "rootfs": str(host_root), "nspawn_pid": nspawn.pid, "console_log": str(log)})
        (work / "state.json").write_text(json.dumps(state, indent=2) + "\n")
    write_client_files(work, count, host_keys)
    for index in range(1, count + 1):
        wait_running(work, index, work / f"{host_name(index)}.console.log")
    return state


def project_name(wheel: str) -> str:
    """The PEP 503 name of a wheel file's project (its first field, normalized): simple/<name>/ holds it."""
    return re.sub(r"[-_.]+", "-", wheel.split("-", 1)[0]).lower()


def stop_index(state: dict) -> None:
    """Stop the package index that ``index`` started, if it runs."""
    pid = state.get("index", {}).get("pid")
    if pid:
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        _wait_gone(pid, 10)


def index(work: Path, wheelhouse: Path, port: int = INDEX_PORT) -> dict:
    """Serve ``wheelhouse`` as a simple index on the bridge; returns {url, pid, log} (also in state.json)."""
    state_file = work / "state.json"
    if not state_file.exists():
        raise RuntimeError(f"no hosts in {work}: run `up` first (the index listens on their bridge)")
    wheels = sorted(wheelhouse.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"{wheelhouse} holds no wheels: make it with `eagle3-pipeline wheelhouse`")
    state = json.loads(state_file.read_text())
    stop_index(state)
    root = work / "index"
    shutil.rmtree(root, ignore_errors=True)
    for wheel in wheels:
        project = root / "simple" / project_name(wheel.name)
        project.mkdir(parents=True, exist_ok=True)
        (project / wheel.name).symlink_to(wheel.resolve())
    address = f"{SUBNET}.1"
    log = work / "index.log"
    with open(log, "ab") as handle:
        server = subprocess.Popen(  # noqa: S603 - argv, no shell
            [sys.executable, "-u", "-m", "http.server", "--bind", address, "--directory", str(root), str(port)],
            stdin=subprocess.DEVNULL, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
        )
    state["index"] = {"url": f"http://{address}:{port}/simple", "pid": server.pid, "log": str(log),
                      "projects": len({project_name(wheel.name) for wheel in wheels})}
    state_file.write_text(json.dumps(state, indent=2) + "\n")
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection((address, port), timeout=1).close()
            return state["index"]
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the index did not start on {address}:{port}: {log.read_text()[-2000:]}") from None
            time.sleep(0.1)


def _processes_rooted_in(rootfs: Path) -> list[int]:
    """PIDs whose root directory is ``rootfs`` (a container's processes, nspawn gone or not)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "root") == str(rootfs):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def down(work: Path = DEFAULT_WORK) -> None:
    """Power the hosts off (SIGTERM to nspawn powers a container off), then remove what ``up`` made."""
    state_file = work / "state.json"
    state = json.loads(state_file.read_text()) if state_file.exists() else {"hosts": []}
    stop_index(state)
    for host in state["hosts"]:
        pid = host["nspawn_pid"]
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        if not _wait_gone(pid, 30):
            os.killpg(pid, signal.SIGKILL)
            _wait_gone(pid, 10)
    for host in state["hosts"]:
        rootfs = Path(host["rootfs"])
        # A container whose nspawn died keeps running under the host's init: end it by its root.
        for pid in _processes_rooted_in(rootfs):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True, check=False).returncode == 0:
        run(["ip", "link", "del", BRIDGE])
    if work.exists():
        shutil.rmtree(work)


def main(argv: list[str] | None = None) -> int:
    """The command line: up, index or down."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["up", "index", "down"])
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="where the hosts and the SSH files go")
    parser.add_argument("--count", type=int, default=2, help="how many hosts (up)")
    parser.add_argument("--wheelhouse", type=Path, help="the wheelhouse to serve as the hosts' index (index)")
    args = parser.parse_args(argv)
    try:
        if args.action == "index":
            if args.wheelhouse is None:
                parser.error("index needs --wheelhouse DIR")
            print(json.dumps(index(args.work.resolve(), args.wheelhouse.resolve())))
        elif args.action == "up":
            started = time.monotonic()
            state = up(args.work.resolve(), args.count)
            print(json.dumps({"hosts": [h["name"] for h in state["hosts"]],
                              "seconds": round(time.monotonic() - started, 1),
                              "ssh_config": str(args.work.resolve() / "ssh_config")}))
        else:
            down(args.work.resolve())
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
