"""Fixtures: a real CPU detattnd (tiny model) on an ipc socket in a temporary directory."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from detattn.model import CONFIGS  # noqa: E402
from detattn.repro import Daemon, find_detattnd  # noqa: E402


@pytest.fixture(scope="session")
def detattnd_path():
    p = os.environ.get("DETATTND") or find_detattnd()
    if not p:
        pytest.skip("no detattnd binary (set DETATTND)")
    return p


@pytest.fixture(scope="module")
def daemon(detattnd_path):
    d = Daemon(detattnd_path, CONFIGS["tiny"], threads=2)
    yield d
    d.close()


@pytest.fixture
def url(daemon):
    return daemon.url
