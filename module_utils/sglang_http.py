"""Talking to an SGLang-compatible server (SGLang itself or the reference engine) over HTTP.

Plain functions over the standard library, so they run on any managed host: wait a while for
the server to answer /health (or its process died, or its systemd unit stopped: then the unit's
state and the log's last lines say why), compare the live /server_info with what was asked, and
send a probe request whose capture file is checked by reading the safetensors header (no torch
needed).
"""

from __future__ import absolute_import, division, print_function

import json
import os
import signal
import struct
import subprocess
import time
import uuid
from urllib.error import HTTPError, URLError
from urllib.request import Request, urlopen


class ServerError(Exception):
    """The server did not answer as needed; ``str()`` says what and what to do."""


def http_json(url, body=None, api_key=None, timeout=10.0):
    """GET (no body) or POST (JSON body) ``url``; return (status, parsed JSON or text)."""
    data = None if body is None else json.dumps(body).encode("utf-8")
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = "Bearer %s" % api_key
    request = Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
    try:
        with urlopen(request, timeout=timeout) as response:
            raw = response.read().decode("utf-8", "replace")
            status = response.status
    except HTTPError as exc:
        raw = exc.read().decode("utf-8", "replace")
        status = exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def log_tail(path, lines=30):
    """The last lines of a log file, or a note that it cannot be read."""
    if not path:
        return "(no log file given)"
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 64 * 1024))
            text = handle.read().decode("utf-8", "replace")
    except OSError as exc:
        return "(cannot read %s: %s)" % (path, exc)
    return "\n".join(text.splitlines()[-lines:])


def pid_running(pid):
    """True when the PID runs and is not a zombie."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as handle:
            state = handle.read().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in (b"Z", b"X")


# The unit's properties that say whether systemd still runs its server, and how its main process ended.
UNIT_PROPERTIES = ("ActiveState", "SubState", "Result", "MainPID", "ExecMainPID", "ExecMainCode", "ExecMainStatus")
# ActiveState values in which the unit's main process runs (or starts).
UNIT_RUNNING = ("active", "activating", "reloading")
# ExecMainCode as systemctl shows it: the si_code of the main process's end (CLD_EXITED, CLD_KILLED, CLD_DUMPED).
UNIT_MAIN_EXITED = ("1", "exited")
UNIT_MAIN_KILLED = ("2", "3", "killed", "dumped")


def unit_state(unit):
    """The systemd unit's state as ``systemctl show`` gives it: {property: value} for UNIT_PROPERTIES."""
    argv = ["systemctl", "show", "--property=" + ",".join(UNIT_PROPERTIES), "--", unit]
    try:
        shown = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ServerError("cannot read the state of the unit %s (%s): %s" % (unit, " ".join(argv), exc)) from exc
    if shown.returncode != 0:
        raise ServerError("cannot read the state of the unit %s: %s" % (unit, (shown.stderr or shown.stdout).strip()))
    return dict(line.split("=", 1) for line in shown.stdout.splitlines() if "=" in line)


def _signal_name(number):
    try:
        return signal.Signals(int(number)).name
    except ValueError:
        return ""


def unit_stopped(unit, state, pid=None):
    """Why ``unit`` no longer runs the server (``pid``: its main process at the start); "" while it does."""
    main = int(state.get("MainPID") or 0)
    active = state.get("ActiveState", "")
    if active in UNIT_RUNNING and main > 0 and (not pid or main == pid):
        return ""
    shown = "ActiveState=%s, SubState=%s, Result=%s" % (active, state.get("SubState", ""), state.get("Result", ""))
    if active in UNIT_RUNNING and main > 0:
        return "the unit %s runs another main process, %d, not the server %d it started: it was restarted (%s)" % (
            unit, main, pid, shown)
    ended = int(state.get("ExecMainPID") or 0) or pid
    code, status = state.get("ExecMainCode", ""), state.get("ExecMainStatus", "")
    if code in UNIT_MAIN_KILLED:
        name = _signal_name(status)
        how = "was killed by signal %s%s" % (status, " (%s)" % name if name else "")
    elif code in UNIT_MAIN_EXITED:
        how = "exited with status %s" % status
    else:
        how = "is not running"
    return "the unit %s stopped: its main process%s %s (%s)" % (unit, " %d" % ended if ended else "", how, shown)


def wait_health(base_url, wait_s, api_key=None, pid=None, log_file=None, poll_s=0.25, unit=None):
    """Poll /health for up to ``wait_s`` seconds; return (ready, seconds waited, the last answer or error).

    Returns as soon as /health answers 200. Fails at once, with the log's last lines, when
    ``pid`` (the server process) has exited, or, given the systemd ``unit`` that runs it, when
    the unit's state says that it no longer runs that process (the failure names the unit and how
    its process ended).
    """
    start = time.monotonic()
    last = "no answer yet"
    while True:
        if unit:
            stopped = unit_stopped(unit, unit_state(unit), pid)
            if stopped:
                raise ServerError(
                    "%s, before the server was ready (systemctl status %s says more); last lines of %s:\n%s"
                    % (stopped, unit, log_file, log_tail(log_file))
                )
        elif pid and not pid_running(pid):
            raise ServerError(
                "the server process %d exited before it was ready; last lines of %s:\n%s"
                % (pid, log_file, log_tail(log_file))
            )
        try:
            status, body = http_json(base_url + "/health", api_key=api_key, timeout=5.0)
            if status == 200:
                return True, round(time.monotonic() - start, 3), "HTTP 200"
            last = "HTTP %d: %s" % (status, str(body)[:200])
        except (URLError, OSError, ValueError) as exc:
            last = str(getattr(exc, "reason", exc))
        elapsed = time.monotonic() - start
        if elapsed >= wait_s:
            return False, round(elapsed, 3), last
        time.sleep(max(0.0, min(poll_s, wait_s - elapsed)))


def not_ready_message(base_url, timeout_s, last, log_file):
    """The server did not answer /health within ``timeout_s``: what to do, and the log's last lines."""
    return (
        "%s/health did not answer 200 within %g s (last: %s); raise sglang_server_ready_timeout_s "
        "for a big model, or read the log. Last lines of %s:\n%s"
        % (base_url, timeout_s, last, log_file, log_tail(log_file))
    )


def wait_ready(base_url, timeout_s, api_key=None, pid=None, log_file=None, poll_s=0.25):
    """Poll /health until it answers 200; return seconds waited.

    Fails at once, with the log's last lines, when ``pid`` (the server process) has exited,
    and after ``timeout_s`` otherwise.
    """
    ready, seconds, last = wait_health(base_url, timeout_s, api_key, pid, log_file, poll_s)
    if not ready:
        raise ServerError(not_ready_message(base_url, timeout_s, last, log_file))
    return seconds


def last_log_line(path, width=160):
    """The log's last non-empty line, cut to ``width`` characters ("" when there is none)."""
    lines = [line.strip() for line in log_tail(path, 20).splitlines() if line.strip()] if path else []
    if not lines or (lines[-1].startswith("(cannot read ") and len(lines) == 1):
        return ""
    line = lines[-1]
    return line if len(line) <= width else line[: width - 1] + "\u2026"


def server_info_mismatches(expected, actual):
    """Fields of /server_info that differ from what was asked: list of (field, wanted, found)."""
    missing = object()
    out = []
    for field in sorted(expected):
        found = actual.get(field, missing) if isinstance(actual, dict) else missing
        if found is missing:
            out.append((field, expected[field], "absent"))
        elif found != expected[field]:
            out.append((field, expected[field], found))
    return out


def safetensors_shapes(path):
    """{tensor name: shape} from a safetensors file's header, read without torch."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        if length > 100 * 1024 * 1024:
            raise ServerError("%s: safetensors header of %d bytes is not plausible" % (path, length))
        header = json.loads(handle.read(length).decode("utf-8"))
    return dict((name, info["shape"]) for name, info in header.items() if name != "__metadata__")


def probe(base_url, capture_dir, num_aux, hidden_size, input_ids, api_key=None, timeout_s=120.0):
    """Send one request and check its capture; return a report dict. Removes the probe's file.

    Checks: prompt_tokens == len(input_ids), cached_tokens == 0, and a capture file with
    ``aux_hidden_states`` [T, num_aux * H] and ``last_hidden_states`` [T, H].
    """
    rid = "eagle3-probe-%s" % uuid.uuid4().hex[:12]
    body = {"input_ids": list(input_ids), "rid": rid, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    start = time.monotonic()
    status, reply = http_json(base_url + "/generate", body, api_key=api_key, timeout=timeout_s)
    seconds = round(time.monotonic() - start, 3)
    if status != 200 or not isinstance(reply, dict):
        raise ServerError("probe request failed: HTTP %d: %s" % (status, str(reply)[:500]))
    meta = reply.get("meta_info", {})
    tokens = len(input_ids)
    problems = []
    if meta.get("prompt_tokens") != tokens:
        problems.append("prompt_tokens is %s, sent %d" % (meta.get("prompt_tokens"), tokens))
    if meta.get("cached_tokens", 0) != 0:
        problems.append("cached_tokens is %s: a prefix came from the radix cache" % meta.get("cached_tokens"))
    path = os.path.join(capture_dir, rid + ".safetensors")
    incomplete = os.path.join(capture_dir, rid + ".incomplete.json")
    shapes = None
    deadline = time.monotonic() + 10.0
    while not os.path.exists(path) and not os.path.exists(incomplete) and time.monotonic() < deadline:
        time.sleep(0.05)
    if os.path.exists(incomplete):
        with open(incomplete) as handle:
            problems.append("the capture was recorded as incomplete: %s" % handle.read().strip())
        os.unlink(incomplete)
    elif not os.path.exists(path):
        problems.append("no capture file %s appeared: is the capture hook loaded?" % path)
    else:
        shapes = safetensors_shapes(path)
        want = {"aux_hidden_states": [tokens, num_aux * hidden_size], "last_hidden_states": [tokens, hidden_size]}
        for name, shape in want.items():
            if shapes.get(name) != shape:
                problems.append("%s has shape %s, expected %s" % (name, shapes.get(name), shape))
        os.unlink(path)
    report = {"rid": rid, "tokens": tokens, "seconds": seconds, "capture_shapes": shapes, "problems": problems}
    if problems:
        raise ServerError("probe %s: %s" % (rid, "; ".join(problems)))
    return report
