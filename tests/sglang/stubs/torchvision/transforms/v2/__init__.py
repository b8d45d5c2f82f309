"""Stub of ``torchvision.transforms.v2`` (transformers imports it when torchvision is present)."""

from torchvision.transforms.functional import InterpolationMode, _Unavailable


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unavailable(f"torchvision.transforms.v2.{name}")


__all__ = ["InterpolationMode"]
