"""Argument types the package's commands share.

A path given as ``''`` is refused by the parser, naming the option: Ansible renders a variable that
was never set as an empty string, and ``Path('')`` is the working directory, so a command that took it
would act on wherever it was started (a home directory) instead of saying the variable is missing.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def path_str(text: str) -> str:
    """A path option's value as given; an empty or blank one is refused."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "an empty path (the variable behind it was left empty?): give a file or directory; "
            "an empty one would mean the working directory"
        )
    return text


def positive_int(text: str) -> int:
    """A count option's value: a whole number >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def path_arg(text: str) -> Path:
    """A path option's value as a Path; an empty or blank one is refused."""
    return Path(path_str(text))


def dataset_arg(text: str):
    """A dataset option (``--dataset``, ``--prompts``): a path, or a mixture's sources as a JSON list
    (``conversations.dataset.parse_sources``)."""
    if not text.lstrip().startswith("["):
        return path_arg(text)
    from eagle3_pipeline.conversations.dataset import parse_sources  # noqa: PLC0415

    try:
        return tuple(parse_sources(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def options_argv(args: argparse.Namespace, actions: list[argparse.Action], skip: tuple[str, ...] = ()) -> list[str]:
    """The options of parsed ``args`` as a command line that parses back to them (for a child process of the
    same command): every option but ``help`` and the destinations in ``skip``; flags only where set, lists
    comma-separated, unset (None) options left out."""
    argv = []
    for action in actions:
        if not action.option_strings or action.dest in ("help", *skip):
            continue
        value = getattr(args, action.dest, None)
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreFalseAction):  # noqa: SLF001 - argparse has no public name
            if value is False:
                argv.append(flag)
        elif isinstance(action, argparse._StoreTrueAction):  # noqa: SLF001
            if value is True:
                argv.append(flag)
        elif isinstance(value, list | tuple):
            argv += [flag, ",".join(map(str, value))]
        elif value is not None:
            argv += [flag, str(value)]
    return argv
