"""Stub of ``torchvision.transforms.v2.functional``: names resolve, any use raises."""

from torchvision.transforms.functional import InterpolationMode, _Unavailable


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unavailable(f"torchvision.transforms.v2.functional.{name}")


__all__ = ["InterpolationMode"]
