"""Every Python block of docs/python.md, run as written against a server with
the default flags' geometry (what scripts/run.sh starts); each print's output
must be what its comment says."""

import os
import re

import pytest

from server import TestServer

DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "python.md")
BLOCKS = re.findall(r"```python\n(.*?)```", open(DOC).read(), re.S)
EXPECTED = re.compile(r"^\s*print\(.*\)\s+#\s*(.+)$")


@pytest.fixture(scope="module")
def default_server():
    with TestServer(num_layers=4, num_pages=1024, page_size=16, num_qo_heads=32,
                    num_kv_heads=4, head_dim=128) as s:
        yield s


def test_the_doc_has_blocks():
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_block(default_server, index, capsys):
    code = BLOCKS[index]
    assert "127.0.0.1:50051" in code
    expected = [m.group(1).strip() for m in map(EXPECTED.match, code.splitlines()) if m]
    exec(compile(code.replace("127.0.0.1:50051", default_server.address),
                 f"docs/python.md block {index}", "exec"), {"__name__": "__main__"})
    printed = [line.strip() for line in capsys.readouterr().out.splitlines()]
    assert printed == expected
