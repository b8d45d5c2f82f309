"""eagle3-pipeline: from GPU hosts to a trained, servable EAGLE-3 drafter, driven by Ansible."""

from pathlib import Path

__version__ = "0.1.0"


def project_root() -> Path:
    """The checkout holding playbooks/, roles/, library/ and ansible.cfg (the package is installed editable)."""
    return Path(__file__).resolve().parents[2]
