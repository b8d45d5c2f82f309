#!/usr/bin/python
"""Ansible module sglang_server_info: wait for an SGLang-compatible server, verify its settings, probe it."""

from __future__ import absolute_import, division, print_function

DOCUMENTATION = r"""
---
module: sglang_server_info
short_description: Wait for an SGLang-compatible server, printing the wait, check its live settings, and probe its capture
description:
  - Polls C(/health) until the server answers, failing early with the log's last lines when
    the server process (O(pid)) exits first, or when the state of its systemd O(unit) says that
    the unit no longer runs it (the failure names the unit and how its main process ended), and
    after O(ready_timeout_s) otherwise.
  - One call waits for up to O(wait_s) seconds; its action plugin calls it again until the
    server is ready, printing after each call a line such as C(waiting for the server at
    http://127.0.0.1:30000, 40 s of at most 1800), then the last answer of C(/health) and the
    last line of O(log_file) (the model loading, say).
  - Once the server is ready, reads C(/server_info) and compares every field of O(expect) with
    the live value; the failure names each field with the value wanted and the value found.
  - With O(probe_input_ids), sends one C(/generate) request and checks C(prompt_tokens), that
    no token came from a cache (C(cached_tokens) is 0), and the capture file the server wrote
    for it (shapes read from the safetensors header). The probe's file is removed afterwards.
  - Changes nothing on the host apart from the probe's own capture file.
options:
  url:
    description: Base URL of the server, e.g. V(http://127.0.0.1:30000).
    type: str
    required: true
  api_key:
    description: API key sent as a bearer token.
    type: str
    no_log: true
  ready_timeout_s:
    description: Seconds to wait for C(/health) in all (counted from O(waited_s), across calls).
    type: float
    default: 600
  poll_s:
    description: Seconds between two requests to C(/health) within one call.
    type: float
    default: 0.5
  pid:
    description: PID of the server process; when it exits the wait fails at once.
    type: int
  unit:
    description:
      - The systemd unit that runs the server (e.g. V(eagle3-reference-30000.service)), O(pid) its main process.
      - Its state is read at every poll; once the unit has stopped (crashed, killed, stopped) or runs
        another main process, the wait fails at once, naming the unit, its state and how its process ended.
      - Once the server answers, its state is returned (RV(unit_state)), and a unit that does not run is a failure
        (something else answers on the port).
    type: str
  log_file:
    description: The server's log, whose last lines go into failure messages (and its last line into the waiting lines).
    type: path
  expect:
    description: Fields that C(/server_info) must show, with their values.
    type: dict
    default: {}
  probe_input_ids:
    description: Token ids of a probe request; empty skips the probe.
    type: list
    elements: int
    default: []
  capture_dir:
    description: Where the server writes captures (needed for the probe).
    type: path
  num_aux:
    description: Number of aux layers captured (needed for the probe).
    type: int
  hidden_size:
    description: Hidden size of the model (needed for the probe).
    type: int
extends_documentation_fragment:
  - polling
notes:
  - Supports check mode (it only reads, and sends the probe).
author:
  - eagle3-pipeline developers
"""

EXAMPLES = r"""
- name: Wait for the server (a line every 30 s while it loads) and check its capture settings
  sglang_server_info:
    url: http://127.0.0.1:30000
    pid: 12345
    log_file: /var/lib/eagle3-pipeline/sglang.log
    ready_timeout_s: 1800
    wait_s: 30
    expect:
      disable_radix_cache: true
      chunked_prefill_size: -1

- name: Wait for a server that systemd runs (a crash fails the wait at the next poll, naming the unit)
  sglang_server_info:
    url: http://127.0.0.1:30000
    pid: 12345
    unit: eagle3-sglang-30000.service
    log_file: /var/lib/eagle3-pipeline/servers/eagle3-sglang-30000.log
    ready_timeout_s: 1800
"""

RETURN = r"""
finished:
  description: Whether the server is ready and verified (and probed, when asked).
  returned: always
  type: bool
ready:
  description: Whether C(/health) answered 200.
  returned: always
  type: bool
seconds_to_ready:
  description: Seconds until /health answered, counted from the task's first call.
  returned: when the server is ready
  type: float
server_info:
  description: The live /server_info.
  returned: when the server is ready
  type: dict
unit_state:
  description: The state of O(unit) once the server answered (C(ActiveState), C(SubState), C(MainPID), ...).
  returned: when O(unit) is given and the server is ready
  type: dict
  sample: {"ActiveState": "active", "SubState": "running", "MainPID": "4242", "Result": "success"}
probe:
  description: The probe's rid, token count, seconds and capture shapes.
  returned: when probe_input_ids is given and the server is ready
  type: dict
msg:
  description: The wait, or the verified server, in one line.
  returned: always
  type: str
  sample: waiting for the server at http://127.0.0.1:30000, 40 s of at most 1800 (last answer [Errno 111] Connection refused)
waited_s:
  description: Seconds the task waited in all, up to the end of the last call.
  returned: always
  type: float
polls:
  description: The calls of the module that the action plugin made (each one SSH round trip).
  returned: always
  type: int
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.sglang_http import (
    ServerError,
    http_json,
    last_log_line,
    not_ready_message,
    probe,
    server_info_mismatches,
    unit_state,
    unit_stopped,
    wait_health,
)


def main():
    """Map options to one call of the wait; once the server is ready, the comparison and the probe."""
    module = AnsibleModule(
        argument_spec=dict(
            url=dict(type="str", required=True),
            api_key=dict(type="str", no_log=True),
            ready_timeout_s=dict(type="float", default=600.0),
            poll_s=dict(type="float", default=0.5),
            pid=dict(type="int"),
            unit=dict(type="str"),
            log_file=dict(type="path"),
            expect=dict(type="dict", default={}),
            probe_input_ids=dict(type="list", elements="int", default=[]),
            capture_dir=dict(type="path"),
            num_aux=dict(type="int"),
            hidden_size=dict(type="int"),
            wait_s=dict(type="float", default=30.0),
            follow=dict(type="bool", default=True),
            waited_s=dict(type="float", default=0.0),
        ),
        supports_check_mode=True,
    )
    p = module.params
    # (required_if cannot say "when the list is not empty": it compares with one value.)
    missing = [name for name in ("capture_dir", "num_aux", "hidden_size") if p[name] is None]
    if p["probe_input_ids"] and missing:
        module.fail_json(msg="probe_input_ids needs %s (the probe checks the capture's file)" % ", ".join(missing))
    base = p["url"].rstrip("/")
    if p["ready_timeout_s"] < 0:
        module.fail_json(msg="ready_timeout_s must be >= 0, got %s" % p["ready_timeout_s"])
    if not 0 <= p["wait_s"] <= 3600:
        module.fail_json(msg="wait_s must be between 0 and 3600 seconds, got %s" % p["wait_s"])
    if not 0 < p["poll_s"] <= 60:
        module.fail_json(msg="poll_s must be > 0 and <= 60 seconds, got %s" % p["poll_s"])
    if p["waited_s"] < 0:
        module.fail_json(msg="waited_s must be >= 0 seconds, got %s" % p["waited_s"])
    result = dict(changed=False, finished=False, ready=False, waited_s=p["waited_s"])
    try:
        wait_s = max(0.0, min(p["wait_s"], p["ready_timeout_s"] - p["waited_s"]))
        ready, seconds, last = wait_health(base, wait_s, p["api_key"], p["pid"], p["log_file"], p["poll_s"], p["unit"])
        result["waited_s"] = waited = round(p["waited_s"] + seconds, 3)
        if not ready:
            if waited >= p["ready_timeout_s"]:
                module.fail_json(msg=not_ready_message(base, p["ready_timeout_s"], last, p["log_file"]), **result)
            line = last_log_line(p["log_file"])
            module.exit_json(msg="waiting for the server at %s, %d s of at most %g (last answer %s)%s" % (
                base, waited, p["ready_timeout_s"], last, "; log: " + line if line else ""), **result)
        result.update(ready=True, seconds_to_ready=waited)
        if p["unit"]:
            result["unit_state"] = state = unit_state(p["unit"])
            stopped = unit_stopped(p["unit"], state, p["pid"])
            if stopped:
                module.fail_json(msg="%s answers, but %s: something else answers on its port" % (base, stopped), **result)
        status, info = http_json(base + "/server_info", api_key=p["api_key"])
        if status != 200 or not isinstance(info, dict):
            module.fail_json(msg="%s/server_info answered HTTP %d: %s" % (base, status, str(info)[:300]), **result)
        result["server_info"] = info
        wrong = server_info_mismatches(p["expect"], info)
        if wrong:
            module.fail_json(
                msg="the live server does not run with the settings asked for: "
                + "; ".join("%s: wanted %r, found %r" % w for w in wrong)
                + ". Something else may hold the port, or an extra argument overrode a capture flag.",
                **result
            )
        if p["probe_input_ids"]:
            result["probe"] = probe(base, p["capture_dir"], p["num_aux"], p["hidden_size"], p["probe_input_ids"], p["api_key"])
    except ServerError as exc:
        module.fail_json(msg=str(exc), **result)
    result["finished"] = True
    result["msg"] = "the server at %s answered after %s s%s%s" % (
        base, result["seconds_to_ready"],
        "; live settings verified: %s" % ", ".join(sorted(p["expect"])) if p["expect"] else "",
        "; probe of %d tokens captured" % result["probe"]["tokens"] if "probe" in result else "")
    module.exit_json(**result)


if __name__ == "__main__":
    main()
