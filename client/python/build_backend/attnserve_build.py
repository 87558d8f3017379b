"""PEP 517 build backend for the attnserve package, in the tree.

It needs nothing but the standard library, so `pip install ./client/python`
works where no package index is reachable: pip's isolated build environment
has nothing to install (pyproject.toml's build-system.requires is empty).

It builds a pure-Python wheel of the `attnserve` package (with the generated,
checked-in attnserve/v1/attention_pb2.py), an sdist, and an editable wheel
(PEP 660: a .pth file naming this directory). Metadata comes from
pyproject.toml's [project] table (read with tomllib: Python 3.11 or newer to
build; the package itself runs on 3.9+); the version from attnserve/_version.py.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import tarfile
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "attnserve"
_EPOCH = (1980, 1, 1, 0, 0, 0)  # fixed zip timestamps: reproducible wheels


def _version() -> str:
    with open(os.path.join(ROOT, PACKAGE, "_version.py"), encoding="utf-8") as f:
        match = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M)
    if not match:
        raise RuntimeError(f"no __version__ in {PACKAGE}/_version.py")
    return match.group(1)


def _project() -> dict:
    try:
        import tomllib
    except ImportError as e:  # Python < 3.11
        raise RuntimeError("building the attnserve wheel needs Python 3.11+ (tomllib); on older "
                           "Pythons put client/python on PYTHONPATH instead") from e
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    if "version" in project.get("dynamic", []):
        project["version"] = _version()
    return project


def _dist_name(project: dict) -> str:
    return f"{project['name'].replace('-', '_')}-{project['version']}"


def _metadata(project: dict) -> str:
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {project['name']}",
        f"Version: {project['version']}",
        f"Summary: {project.get('description', '')}",
        f"Requires-Python: {project.get('requires-python', '')}",
    ]
    if "license" in project:
        lines.append(f"License: {project['license'].get('text', '')}")
    lines += [f"Requires-Dist: {dep}" for dep in project.get("dependencies", [])]
    for extra, deps in project.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        lines += [f'Requires-Dist: {dep}; extra == "{extra}"' for dep in deps]
    readme = project.get("readme")
    body = ""
    if readme:
        lines.append("Description-Content-Type: text/markdown")
        with open(os.path.join(ROOT, readme), encoding="utf-8") as f:
            body = "\n" + f.read()
    return "\n".join(lines) + "\n" + body


def _package_files() -> list:
    """(path in the archive, path on disk) of every module of the package."""
    out = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, PACKAGE)):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith((".py", ".typed")):
                full = os.path.join(dirpath, name)
                out.append((os.path.relpath(full, ROOT).replace(os.sep, "/"), full))
    return out


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def _write_wheel(wheel_directory: str, files: list) -> str:
    """files: [(archive path, bytes)]; adds dist-info and RECORD; returns the name."""
    project = _project()
    dist = _dist_name(project)
    info = f"{dist}.dist-info"
    files = list(files) + [
        (f"{info}/METADATA", _metadata(project).encode()),
        (f"{info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: attnserve_build\n"
                          b"Root-Is-Purelib: true\nTag: py3-none-any\n"),
        (f"{info}/top_level.txt", f"{PACKAGE}\n".encode()),
    ]
    record = [_record_line(p, d) for p, d in files] + [f"{info}/RECORD,,"]
    files.append((f"{info}/RECORD", ("\n".join(record) + "\n").encode()))
    name = f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w", zipfile.ZIP_DEFLATED) as z:
        for path, data in files:
            entry = zipfile.ZipInfo(path, _EPOCH)
            entry.external_attr = 0o644 << 16
            entry.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(entry, data)
    return name


# ---------------------------------------------------------------- PEP 517
def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    files = []
    for arc, full in _package_files():
        with open(full, "rb") as f:
            files.append((arc, f.read()))
    return _write_wheel(wheel_directory, files)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    # A .pth line puts this directory on sys.path: edits take effect at once.
    return _write_wheel(wheel_directory, [(f"_{PACKAGE}_editable.pth", (ROOT + "\n").encode())])


def build_sdist(sdist_directory, config_settings=None):
    project = _project()
    dist = _dist_name(project)
    name = f"{dist}.tar.gz"
    members = [("pyproject.toml", os.path.join(ROOT, "pyproject.toml")),
               ("build_backend/attnserve_build.py", os.path.abspath(__file__))]
    readme = project.get("readme")
    if readme:
        members.append((readme, os.path.join(ROOT, readme)))
    members += _package_files()
    with tarfile.open(os.path.join(sdist_directory, name), "w:gz") as tar:
        pkg_info = _metadata(project).encode()
        entry = tarfile.TarInfo(f"{dist}/PKG-INFO")
        entry.size, entry.mtime, entry.mode = len(pkg_info), int(time.time()), 0o644
        tar.addfile(entry, io.BytesIO(pkg_info))
        for arc, full in members:
            tar.add(full, arcname=f"{dist}/{arc}")
    return name
