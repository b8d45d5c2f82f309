"""`ansible-doc -M library NAME` renders every module, and its options are the module's argument_spec."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sysconfig
from pathlib import Path
from unittest import mock

import pytest
from ansible.module_utils import basic

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(sysconfig.get_path("scripts"))


def argument_spec(module: str) -> dict[str, dict]:
    """The argument_spec that a module's ``main()`` gives AnsibleModule (caught there, before any work).

    Read at run time, not from the source: the progress modules build theirs from the options they
    share (module_utils/job_progress.py) and their own.
    """
    captured: dict[str, dict] = {}

    class Caught(Exception):
        pass

    def catch(self, argument_spec, **kwargs):
        captured.update(argument_spec)
        raise Caught

    loaded = importlib.import_module(module)
    with mock.patch.object(basic.AnsibleModule, "__init__", catch), pytest.raises(Caught):
        loaded.main()
    assert captured, f"library/{module}.py gave AnsibleModule no argument_spec"
    return captured


def options_section(text: str) -> str:
    """The OPTIONS section of ansible-doc's plain-text rendering (up to the next section)."""
    start = text.index("\nOPTIONS")
    ends = [text.find(f"\n{name}", start + 1) for name in ("NOTES", "REQUIREMENTS", "AUTHOR", "EXAMPLES")]
    return text[start : min(end for end in ends if end > 0)]


def ansible_doc(*args: str) -> subprocess.CompletedProcess:
    """Run ansible-doc from the repository root, as the README tells, with the venv first on PATH."""
    env = dict(os.environ, PATH=os.pathsep.join([str(SCRIPTS), os.environ.get("PATH", "")]), ANSIBLE_NOCOLOR="1")
    env["ANSIBLE_CONFIG"] = str(ROOT / "ansible.cfg")
    return subprocess.run(
        ["ansible-doc", "-M", "library", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


MODULES = sorted(path.stem for path in (ROOT / "library").glob("*.py"))


def test_every_module_of_the_library_is_checked():
    assert {"gpu_info", "gpu_processes", "gpu_wait_free", "sglang_server_info", "job_progress"} <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_ansible_doc_renders_every_option(module):
    spec = argument_spec(module)

    text = ansible_doc(module)

    assert text.returncode == 0, text.stderr
    assert "[ERROR]" not in text.stderr and "[WARNING]" not in text.stderr, text.stderr
    assert f"> MODULE {module} " in text.stdout
    for section in ("OPTIONS", "EXAMPLES", "RETURN VALUES"):
        assert f"\n{section}" in text.stdout, section
    options_text = options_section(text.stdout)
    for name in spec:
        # ansible-doc marks a required option "= name", an optional one "- name".
        assert re.search(rf"^[-=] {name}\s", options_text, re.MULTILINE), f"option {name} not rendered"

    rendered = ansible_doc("--json", module)
    assert rendered.returncode == 0, rendered.stderr
    options = json.loads(rendered.stdout)[module]["doc"]["options"]
    assert set(options) == set(spec), "DOCUMENTATION options differ from argument_spec"
    for name, declared in spec.items():
        documented = options[name]
        assert documented.get("type", "str") == declared.get("type", "str"), name
        assert documented.get("default") == declared.get("default"), name
        assert documented.get("choices") == declared.get("choices"), name
        assert documented.get("elements") == declared.get("elements"), name
