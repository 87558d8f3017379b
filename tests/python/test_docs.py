"""Every Python block of docs/python.md, run as written against a server with
the default flags' geometry (what scripts/run.sh starts), or, for a block that
names 127.0.0.1:50056, against the doc's multi-head latent attention server;
each print's output must be what its comment says."""

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


# docs/python.md, "Multi-head latent attention": the server its run.sh block
# starts (the defaults otherwise, as the default server's).
MLA_ADDRESS = "127.0.0.1:50056"


@pytest.fixture(scope="module")
def mla_server():
    with TestServer(num_layers=2, num_pages=1024, page_size=16, num_qo_heads=16,
                    attention="mla", kv_lora_rank=512, qk_rope_head_dim=64) as s:
        yield s


def test_the_doc_has_blocks():
    assert len(BLOCKS) >= 5
    assert any(MLA_ADDRESS in b for b in BLOCKS)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_block(request, index, capsys):
    code = BLOCKS[index]
    address = MLA_ADDRESS if MLA_ADDRESS in code else "127.0.0.1:50051"
    assert address in code
    server = request.getfixturevalue("mla_server" if address == MLA_ADDRESS
                                     else "default_server")
    expected = [m.group(1).strip() for m in map(EXPECTED.match, code.splitlines()) if m]
    exec(compile(code.replace(address, server.address),
                 f"docs/python.md block {index}", "exec"), {"__name__": "__main__"})
    printed = [line.strip() for line in capsys.readouterr().out.splitlines()]
    assert printed == expected


# docs/flashinfer.md: its python blocks that the docs runner runs (not those
# marked `<!-- not run: ... -->`), against one server with the default
# geometry and shared memory on, standing for both of the page's servers.
FI_DOC = os.path.join(os.path.dirname(DOC), "flashinfer.md")
FI_BLOCKS = [m.group(2) for m in re.finditer(r"(<!--[^\n]*-->\n)?```python\n(.*?)```",
                                             open(FI_DOC).read(), re.S)
             if not (m.group(1) or "").startswith("<!-- not run")]


@pytest.fixture(scope="module")
def shm_server():
    with TestServer(num_layers=4, num_pages=1024, page_size=16, num_qo_heads=32,
                    num_kv_heads=4, head_dim=128, extra_flags=["--allow_shared_memory"]) as s:
        yield s


# docs/flashinfer.md, "Multi-head latent attention": its MLA server.
FI_MLA_ADDRESS = "127.0.0.1:50057"


def test_flashinfer_doc_has_blocks():
    assert len(FI_BLOCKS) == 4
    assert sum(FI_MLA_ADDRESS in b for b in FI_BLOCKS) == 1


@pytest.mark.parametrize("index", range(len(FI_BLOCKS)))
def test_flashinfer_block(request, index, capsys):
    code = FI_BLOCKS[index]
    expected = [m.group(1).strip() for m in map(EXPECTED.match, code.splitlines()) if m]
    if FI_MLA_ADDRESS in code:
        code = code.replace(FI_MLA_ADDRESS, request.getfixturevalue("mla_server").address)
    shm_server = request.getfixturevalue("shm_server")
    for address in ("127.0.0.1:50051", "127.0.0.1:50054"):
        code = code.replace(address, shm_server.address)
    exec(compile(code, f"docs/flashinfer.md block {index}", "exec"), {"__name__": "__main__"})
    printed = [line.strip() for line in capsys.readouterr().out.splitlines()]
    assert printed == expected and expected
