"""The example inventories hold only variables the roles know, each of the type and among the choices the role's
argument spec allows: an operator who starts from one gets no typo in a variable's name or value."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "inventory" / "examples").glob("*.yml"))
ROLES = sorted(path.parent.parent.name for path in (ROOT / "roles").glob("*/meta/argument_specs.yml"))
# Variables of the inventories that no role's spec holds: connection and play-level settings.
NOT_ROLE_VARIABLES = ("ansible_",)


def _specs() -> dict[str, dict]:
    specs = {}
    for role in ROLES:
        document = yaml.safe_load((ROOT / "roles" / role / "meta" / "argument_specs.yml").read_text())
        specs[role] = document["argument_specs"]["main"]["options"]
    return specs


def _variables(node: dict) -> dict:
    """Every variable of an inventory: each group's and host's vars, merged (the examples set each one once)."""
    found = dict(node.get("vars") or {})
    for host in (node.get("hosts") or {}).values():
        found.update(host or {})
    for child in (node.get("children") or {}).values():
        found.update(_variables(child or {}))
    return found


@pytest.mark.parametrize("inventory", EXAMPLES, ids=[path.name for path in EXAMPLES])
def test_every_variable_of_the_example_is_a_roles_and_valid(inventory):
    specs = _specs()
    variables = _variables(yaml.safe_load(inventory.read_text())["all"])
    owner = {name: role for role, options in specs.items() for name in options}
    unknown = sorted(name for name in variables if name not in owner and not name.startswith(NOT_ROLE_VARIABLES))
    assert not unknown, f"{inventory.name}: no role has {unknown}"
    for role, options in specs.items():
        given = {name: value for name, value in variables.items() if owner.get(name) == role}
        if not given:
            continue
        # Values may be Jinja (rendered at run time): only the literal ones are checked.
        literal = {name: value for name, value in given.items() if not (isinstance(value, str) and "{{" in value)}
        spec = {name: {key: value for key, value in options[name].items() if key in ("type", "choices", "elements")}
                for name in literal}
        result = ArgumentSpecValidator(spec).validate(literal)
        assert not result.error_messages, f"{inventory.name}, role {role}: {result.error_messages}"
