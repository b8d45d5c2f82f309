"""Stub of ``torchvision.transforms``: names resolve, any use raises (see the package docstring)."""

from torchvision.transforms.functional import InterpolationMode, _Unavailable


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unavailable(f"torchvision.transforms.{name}")


__all__ = ["InterpolationMode"]
