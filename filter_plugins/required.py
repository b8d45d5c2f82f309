"""Filters of the roles' preflights: which variables that must be set were left empty."""

from __future__ import annotations


def blank(variables: dict) -> list[str]:
    """The names, in order, of ``variables`` whose value is unset: None, or a string of nothing but blanks.

    A role's required path that an inventory left at its empty default, or set from an environment
    variable that was not exported, renders as ''; a command given '' as a path would act on its working
    directory. The preflights refuse such a variable by its name: ``{'a': a, 'b': b} | blank``.
    """
    return [name for name, value in variables.items()
            if value is None or (isinstance(value, str) and not value.strip())]


class FilterModule:
    """Ansible's entry point for this file's filters."""

    def filters(self) -> dict:
        return {"blank": blank}
