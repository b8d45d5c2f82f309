"""eagle3-pipeline: from GPU hosts to a trained, servable EAGLE-3 drafter, driven by Ansible.

``eagle3_pipeline.run(stage, inventory=..., extravars=..., on_event=...)`` runs a stage of the
pipeline through ansible-runner (see ``eagle3_pipeline.runner`` and docs/python-api.md). The
runner's names are imported on first use, so importing the package loads no Ansible code.
"""

from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0"

# Names served lazily from eagle3_pipeline.runner.
_RUNNER_NAMES = ("run", "RunResult", "PipelineError", "HostStats", "TaskFailure", "STAGES")
__all__ = ["STAGES", "HostStats", "PipelineError", "RunResult", "TaskFailure", "__version__", "project_root", "run"]


def project_root() -> Path:
    """The checkout holding playbooks/, roles/, library/ and ansible.cfg (the package is installed editable)."""
    return Path(__file__).resolve().parents[2]


def __getattr__(name: str):
    """Import the runner on first use of one of its names (PEP 562)."""
    if name in _RUNNER_NAMES:
        from eagle3_pipeline import runner  # noqa: PLC0415

        return getattr(runner, name)
    raise AttributeError(f"module 'eagle3_pipeline' has no attribute {name!r}")
