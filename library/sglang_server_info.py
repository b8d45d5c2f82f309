#!/usr/bin/python
"""Ansible module sglang_server_info: wait for an SGLang-compatible server, verify its settings, probe it."""

from __future__ import absolute_import, division, print_function

DOCUMENTATION = r"""
---
module: sglang_server_info
short_description: Wait for an SGLang-compatible server, check its live settings, and probe its capture
description:
  - Polls C(/health) until the server answers, failing early with the log's last lines when
    the server process (O(pid)) exits first.
  - Reads C(/server_info) and compares every field of O(expect) with the live value; the
    failure names each field with the value wanted and the value found.
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
    description: Seconds to wait for C(/health).
    type: float
    default: 600
  pid:
    description: PID of the server process; when it exits the wait fails at once.
    type: int
  log_file:
    description: The server's log, whose last lines go into failure messages.
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
notes:
  - Supports check mode (it only reads, and sends the probe).
author:
  - eagle3-pipeline developers
"""

EXAMPLES = r"""
- name: Wait for the server and check its capture settings
  sglang_server_info:
    url: http://127.0.0.1:30000
    expect:
      disable_radix_cache: true
      chunked_prefill_size: -1
"""

RETURN = r"""
seconds_to_ready:
  description: Seconds until /health answered.
  returned: always
  type: float
server_info:
  description: The live /server_info.
  returned: always
  type: dict
probe:
  description: The probe's rid, token count, seconds and capture shapes.
  returned: when probe_input_ids is given
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.sglang_http import ServerError, http_json, probe, server_info_mismatches, wait_ready


def main():
    """Map options to the wait, the comparison and the probe."""
    module = AnsibleModule(
        argument_spec=dict(
            url=dict(type="str", required=True),
            api_key=dict(type="str", no_log=True),
            ready_timeout_s=dict(type="float", default=600.0),
            pid=dict(type="int"),
            log_file=dict(type="path"),
            expect=dict(type="dict", default={}),
            probe_input_ids=dict(type="list", elements="int", default=[]),
            capture_dir=dict(type="path"),
            num_aux=dict(type="int"),
            hidden_size=dict(type="int"),
        ),
        supports_check_mode=True,
        required_if=[("probe_input_ids", [], ["capture_dir", "num_aux", "hidden_size"], True)],
    )
    p = module.params
    base = p["url"].rstrip("/")
    if p["ready_timeout_s"] < 0:
        module.fail_json(msg="ready_timeout_s must be >= 0, got %s" % p["ready_timeout_s"])
    result = dict(changed=False)
    try:
        result["seconds_to_ready"] = wait_ready(base, p["ready_timeout_s"], p["api_key"], p["pid"], p["log_file"])
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
    module.exit_json(**result)


if __name__ == "__main__":
    main()
