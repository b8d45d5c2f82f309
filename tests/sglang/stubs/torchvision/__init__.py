"""Import-only stand-in for torchvision in the SGLang contract-test venv.

PyPI's torchvision wheels are built against CUDA torch and cannot load their operators against
the project's CPU torch, yet SGLang's config package imports ``torchvision.transforms`` at module
level (for image preprocessing of vision models, which these tests never run). This stub lets
those imports succeed; any real use raises, so it cannot change a result silently. conftest.py
puts it on sys.path only when no torchvision is installed.
"""

__version__ = "0.0.0+stub"
STUB = True


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    from torchvision.transforms.functional import _Unavailable

    return _Unavailable(f"torchvision.{name}")
