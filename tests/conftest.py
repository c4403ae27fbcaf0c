"""Fixtures several test files share."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers.commands import EXAMPLES, ok


@pytest.fixture(scope="session")
def gpt_data(tmp_path_factory):
    """examples/gpt.py's `--data` file (96 samples), made once per session."""
    path = tmp_path_factory.mktemp("data") / "gpt.safetensors"
    ok(subprocess.run([sys.executable, str(EXAMPLES / "prepare_data.py"), "--samples", "96", "-o", str(path)], capture_output=True, text=True))
    return path
