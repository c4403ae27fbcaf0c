"""Fixtures several test files share."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers.artifacts import open_session
from helpers.commands import EXAMPLES, ok


@pytest.fixture(scope="session")
def gpt_data(tmp_path_factory):
    """examples/gpt.py's `--data` file (96 samples), made once per session."""
    path = tmp_path_factory.mktemp("data") / "gpt.safetensors"
    ok(subprocess.run([sys.executable, str(EXAMPLES / "prepare_data.py"), "--samples", "96", "-o", str(path)], capture_output=True, text=True))
    return path


@pytest.fixture(scope="session", autouse=True)
def built(tmp_path_factory):
    """built(model, *build args) -> a read-only artifact folder, each distinct build made once per
    session (helpers/artifacts.py); copy one with helpers.artifacts.writable_copy to alter it.
    Opened for every session: helpers.training.train_both builds through it too."""
    cache = open_session(tmp_path_factory.mktemp("built"))
    yield cache
    cache.close()
