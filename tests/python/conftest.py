"""Fixtures for the Python client tests: a real CPU server per module.

ctest runs these with ATTNSERVE_BIN set and PYTHONPATH naming client/python
and examples/ (tests/python/CMakeLists.txt); run by hand from the repository
root with the same:

    PYTHONPATH=client/python:examples:tests/python ATTNSERVE_BIN=build/bin/attnserve \
      /usr/bin/python3 -m pytest -q tests/python
"""

import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
for path in (os.path.join(_ROOT, "client", "python"), os.path.join(_ROOT, "examples"), _HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

import attnserve  # noqa: E402
from server import TestServer  # noqa: E402


@pytest.fixture(scope="module")
def server():
    """Two layers, 256 pages of 16, 8 query / 2 KV heads of 64, bf16."""
    with TestServer() as s:
        yield s


@pytest.fixture
def client(server):
    c = attnserve.Client(server.address, timeout=120)
    yield c
    c.close()
