"""Stub of ``torchvision.io``: names resolve, any use raises."""

from torchvision.transforms.functional import _Unavailable


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unavailable(f"torchvision.io.{name}")
