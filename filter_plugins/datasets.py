"""Filters of the roles that read conversations: a dataset variable is a path, or a mixture's list of sources."""

from __future__ import annotations

import json


def dataset_paths(value) -> list[str]:
    """The paths a dataset variable names: ``[path]``, or each source's ``path`` of a mixture (a list of
    ``{path, name, count or weight}``); an entry without a path gives '' (the preflights refuse it)."""
    if isinstance(value, (list, tuple)):
        return [str(entry.get("path") or "") if isinstance(entry, dict) else "" for entry in value]
    return [str(value)]


def dataset_arg(value) -> str:
    """The jobs' ``--dataset`` for a dataset variable: the path, or the mixture as one JSON argument."""
    if isinstance(value, (list, tuple)):
        return json.dumps([dict(entry) for entry in value], sort_keys=True)
    return str(value)


class FilterModule:
    """Ansible's entry point for this file's filters."""

    def filters(self) -> dict:
        return {"dataset_paths": dataset_paths, "dataset_arg": dataset_arg}
