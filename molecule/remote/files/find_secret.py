"""Find the files that hold a secret, byte for byte: under the paths given (files, or directories walked
without following links).

The secret comes on standard input, never on a command line (where ps, sudo's log and the journal would
keep it). Prints {"found": [paths], "files": N, "bytes": N, "unreadable": [paths]}. molecule/remote's
verify runs it on the controller and on the hosts with the become password.

    python3 find_secret.py PATH... < secret
"""

from __future__ import annotations

import json
import os
import sys

CHUNK = 1 << 20


def files_under(path: str):
    """The regular files at or under ``path`` (links not followed; a missing path has none)."""
    if os.path.isfile(path) and not os.path.islink(path):
        yield path
        return
    for root, _dirs, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            if os.path.isfile(full) and not os.path.islink(full):
                yield full


def holds(path: str, secret: bytes) -> bool:
    """Whether the file's bytes contain ``secret`` (read in chunks, across their borders)."""
    keep = len(secret) - 1
    tail = b""
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            if secret in tail + block:
                return True
            tail = (tail + block)[-keep:] if keep else b""
    return False


def main() -> int:
    """Scan the paths of the command line for the secret read from standard input."""
    secret = sys.stdin.buffer.read().strip()
    if len(secret) < 8:
        print("error: give the secret (at least 8 bytes) on standard input", file=sys.stderr)
        return 2
    report = {"found": [], "files": 0, "bytes": 0, "unreadable": []}
    for path in sys.argv[1:]:
        for name in files_under(path):
            try:
                found = holds(name, secret)
                report["bytes"] += os.path.getsize(name)
            except OSError:
                report["unreadable"].append(name)
                continue
            report["files"] += 1
            if found:
                report["found"].append(name)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
