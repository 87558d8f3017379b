#!/usr/bin/env python3
"""Runs every command block of README.md and docs/*.md as a newcomer would.

  python3 tests/readme/readme_test.py [DOC...]     (default: README.md, then docs/*.md)

The server is started exactly as the README's first command block says
(`scripts/run.sh`), in the background from the repository root, and the test
waits until `attnctl health` answers SERVING. Then every other command block
(```sh, ```bash, ```shell or a bare ```) runs in order, from the repository
root, in one bash each; every command in it must exit 0 (both sides of an
`a && b` too). The block that is only `scripts/test.sh` is left out: it is
what CI runs before this test. Blocks are read from the documents here, so a
new block is covered without touching this file.

Then each doc of docs/*.md, against the same server: its shell blocks as
above, and its ```python blocks with the client on PYTHONPATH. `python3`, in
a block or as the interpreter of a python block, is one that imports grpc and
numpy (Debian's /usr/bin/python3 first), as on the fresh Debian 12 machine
the docs are written for, whatever python3 comes first on this PATH. A shell
block that is only `scripts/run.sh ARGS` starts a second server, as a reader
would in another terminal: it runs in the background until the doc's last
block has run, then gets SIGTERM and must exit 0; the test waits for its
`listening` line first. Processes a block leaves in the background are ended
with the doc. A block right after a line `<!-- not run: REASON -->` is shown,
not run (a GPU, a fragment of a larger program, what CI runs anyway); blocks
in other languages (cpp, promql, yaml, text) are not commands.

Besides exit codes, what the docs claim is checked where that is cheap:
  - `COMMAND  # -> TEXT`: COMMAND prints exactly TEXT;
  - `print(...)  # TEXT` in a python block: that line prints exactly TEXT;
  - `--json=PATH`: PATH is attnbench's JSON, with requests and no errors;
  - `wrote FILE.png` in a block's output: FILE.png is a PNG;
  - `cmake --install BUILD --prefix PREFIX`: PREFIX/bin/attnserve --version
    runs and PREFIX holds the CMake package.
The server is stopped with SIGTERM at the end and must drain and exit 0.
Everything listens on and talks to loopback only (the README's defaults,
127.0.0.1:50051 and 127.0.0.1:9464); the test fails at once if either port
is taken. A doc's commands may create directories at the top of the
repository (build trees, an install, a virtual environment) but no loose
files (results belong elsewhere, e.g. /tmp); whatever they create there is
removed afterwards.

Prints one line per check and a last line "N passed, N failed".
"""
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
README = os.path.join(ROOT, "README.md")
SHELL_LANGS = {"", "sh", "bash", "shell"}
SECOND_SERVER_START_TIMEOUT_S = 300
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.+?)\s*-->\s*$")
PRINT_CLAIM = re.compile(r"^\s*print\(.*\)\s+#\s*(.+)$")
PORTS = (50051, 9464)             # the README's default gRPC and metrics ports
SERVER_START_TIMEOUT_S = 3600     # includes a first build on a fresh machine
BLOCK_TIMEOUT_S = 1800            # "Building by hand" runs every test
DRAIN_TIMEOUT_S = 60

passed = 0
failed = 0


def check(name, ok, detail=""):
    global passed, failed
    if ok:
        passed += 1
        print(f"PASS: {name}", flush=True)
    else:
        failed += 1
        print(f"FAIL: {name}", flush=True)
        if detail:
            print("\n".join("    " + line for line in failure_lines(detail)), flush=True)


# A test runner's output (ctest --output-on-failure) ends with the list of
# failed tests; the assertions that failed come far earlier. Both are shown.
FAILURE_MARK = re.compile(r": Failure$|^\[  FAILED  \]|^\s*(Expected|Which is|Value of)[: ]")


def failure_lines(detail, tail=60, context=40):
    """The detail's last `tail` lines, preceded by the `context` lines from
    the first gtest failure mark before them (if any)."""
    lines = detail.rstrip().splitlines()
    start = max(0, len(lines) - tail)
    first = next((i for i, line in enumerate(lines[:start]) if FAILURE_MARK.search(line)), None)
    if first is None:
        return lines[start:]
    head = lines[max(0, first - 5):min(start, first + context)]
    return head + [f"... ({start - min(start, first + context)} lines left out)"] + lines[start:]


def code_blocks(text):
    """(line number, info string, body, reason not run or None) of every fenced block."""
    blocks = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2), i + 1
        skip = NOT_RUN.match(lines[i - 1]) if i > 0 else None
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        blocks.append((start, lang.lower(), "\n".join(body), skip.group(1) if skip else None))
        i += 1
    return blocks


def logical_commands(body):
    """The block's commands, continuation lines joined; comments and blank lines dropped."""
    commands, current = [], ""
    for line in body.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        commands.append(current + line)
        current = ""
    if current:
        commands.append(current)
    return commands


def split_claim(command):
    """(command without the comment, claimed output or None) for `CMD  # -> TEXT`."""
    m = re.match(r"^(.*?)\s+#\s*->\s*(.*?)\s*$", command)
    return (m.group(1), m.group(2)) if m else (command, None)


def block_script(commands):
    """A bash script that runs the commands in order, stops at the first that
    exits non-zero (also inside `a && b`, which `set -e` would let pass), and
    checks `# -> TEXT` claims."""
    lines = ["set -o pipefail"]
    for command in commands:
        cmd, claim = split_claim(command)
        failed = sh_quote(f"README command failed: {cmd.strip()}")
        if claim is None:
            lines.append(command)
        else:
            lines.append(f"__out=$({cmd}\n)")
        lines.append(f'__rc=$?; if ((__rc != 0)); then echo {failed}" (exit $__rc)" >&2; exit $__rc; fi')
        if claim is not None:
            message = f"README claims `{cmd.strip()}` prints {claim!r}; it printed:"
            lines.append('printf "%s\\n" "$__out"')
            lines.append(f'if [[ "$__out" != {sh_quote(claim)} ]]; then echo {sh_quote(message)} >&2; '
                         'printf "%s\\n" "$__out" >&2; exit 97; fi')
    return "\n".join(lines) + "\n"


def sh_quote(s):
    return "'" + s.replace("'", "'\\''") + "'"


def port_free(port):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def claims_after(commands, output):
    """Cheap checks of what a block's commands claim, once they have run."""
    for command in commands:
        cmd, _ = split_claim(command)
        m = re.search(r"--json=(\S+)", cmd)
        if m and "attnbench" in cmd:
            path = os.path.join(ROOT, m.group(1))
            try:
                r = json.load(open(path))
                ok = r["requests"] > 0 and r["ok"] == r["requests"] and r["errors"] == 0
                check(f"  {m.group(1)} is attnbench's JSON: {r['requests']} requests, no errors", ok,
                      json.dumps({k: r.get(k) for k in ("requests", "ok", "errors", "errors_by_code")}))
            except (OSError, ValueError, KeyError) as e:
                check(f"  {m.group(1)} is attnbench's JSON", False, repr(e))
        m = re.search(r"cmake --install\s+(\S+)\s+--prefix\s+(\S+)", cmd)
        if m:
            prefix = subprocess.run(["bash", "-c", f"cd {sh_quote(ROOT)} && echo {m.group(2)}"],
                                    capture_output=True, text=True).stdout.strip()
            version = subprocess.run([os.path.join(prefix, "bin", "attnserve"), "--version"],
                                     capture_output=True, text=True)
            check(f"  {prefix}/bin/attnserve --version runs: {version.stdout.strip()}",
                  version.returncode == 0, version.stderr)
            config = os.path.join(prefix, "lib", "cmake", "attnserve", "attnserveConfig.cmake")
            check(f"  the install tree holds the CMake package", os.path.isfile(config), config)
    for png in re.findall(r"^wrote (\S+\.png)$", output, re.M):
        path = os.path.join(ROOT, png)
        try:
            with open(path, "rb") as f:
                ok = f.read(8) == b"\x89PNG\r\n\x1a\n"
        except OSError:
            ok = False
        check(f"  {png} is a PNG", ok)


def python_for_docs():
    """A python3 that imports the client's dependencies: /usr/bin/python3 first."""
    for candidate in ("/usr/bin/python3", shutil.which("python3")):
        if candidate and subprocess.run([candidate, "-c", "import grpc, numpy"],
                                        capture_output=True).returncode == 0:
            return candidate
    return None


def python_first(python):
    """The environment for the docs' blocks: `python3` on PATH is `python`."""
    if python is None:
        return dict(os.environ)
    bindir = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"docs-python-{os.getpid()}")
    os.makedirs(bindir, exist_ok=True)
    link = os.path.join(bindir, "python3")
    if not os.path.islink(link):
        os.symlink(python, link)
    return dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""))


def run_block(script, env=None):
    """(exit code or "timeout", output, process group id) of one bash script
    run from the repository root in a session of its own."""
    proc = subprocess.Popen(["bash", "-c", script], cwd=ROOT, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    try:
        output, _ = proc.communicate(timeout=BLOCK_TIMEOUT_S)
        return proc.returncode, output, proc.pid
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return "timeout", output, proc.pid


def end_group(pgid):
    """Ends what a block left running in the background (its process group)."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class SecondServer:
    """A block that is only `scripts/run.sh ARGS`, run in the background."""

    def __init__(self, where, command):
        self.where, self.command = where, command
        self.log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                     f"docs-server-{os.getpid()}-{id(self)}.log"), "w+")
        m = re.search(r"--listen=\S*:(\d+)", command)
        self.port = int(m.group(1)) if m else None
        self.proc = None

    def start(self):
        if self.port is not None and not port_free(self.port):
            check(f"{self.where}: port {self.port} is free for `{self.command}`", False)
            return False
        self.proc = subprocess.Popen(["bash", "-c", self.command], cwd=ROOT, stdout=self.log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + SECOND_SERVER_START_TIMEOUT_S
        listening = False
        while time.monotonic() < deadline and self.proc.poll() is None and not listening:
            time.sleep(0.1)
            self.log.seek(0)
            listening = "listening grpc=" in self.log.read()
        self.log.seek(0)
        check(f"{self.where}: `{self.command}` serves in the background", listening,
              self.log.read())
        return listening

    def stop(self):
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(DRAIN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.seek(0)
        check(f"{self.where}: the second server drains on SIGTERM and exits 0",
              self.proc.returncode == 0, f"exit {self.proc.returncode}\n{self.log.read()}")
        self.log.close()
        os.unlink(self.log.name)


def shown(commands):
    text = re.sub(r"\s+", " ", re.sub(r"\s+#.*$", "", commands[0]).strip())
    return text + (f"` and {len(commands) - 1} more: each" if len(commands) > 1 else "`")


def run_doc(path, blocks, python):
    """Every runnable block of one document, in order (README.md's first one,
    the server, already running)."""
    name = os.path.relpath(path, ROOT)
    env = python_first(python) if path != README else None
    servers, groups = [], []
    try:
        for line, lang, body, not_run in blocks:
            where = f"{name}:{line}"
            if lang not in SHELL_LANGS and lang != "python":
                continue
            if not_run is not None:
                print(f"{where}: a ```{lang} block, not run: {not_run}")
                continue
            if lang == "python":
                run_python(where, body, python)
                continue
            commands = logical_commands(body)
            if not commands:
                continue
            if commands == ["scripts/test.sh"]:
                print(f"{where}: `scripts/test.sh` left out: CI runs it before this test")
                continue
            if len(commands) == 1 and re.match(r"^scripts/run\.sh\s", commands[0]):
                server = SecondServer(where, commands[0])
                servers.append(server)
                if not server.start():
                    return
                continue
            started = time.monotonic()
            rc, output, pgid = run_block(block_script(commands), env)
            groups.append(pgid)
            check(f"{where}: `{shown(commands)} exits 0 ({time.monotonic() - started:.0f} s)",
                  rc == 0, f"exit {rc}\n{output}")
            if rc == 0:
                claims_after(commands, output)
    finally:
        for pgid in groups:
            end_group(pgid)
        for server in reversed(servers):
            server.stop()


def run_python(where, code, python):
    """A python block, with the client importable; each `print(...)  # TEXT`
    line must print TEXT."""
    if python is None:
        check(f"{where}: a python3 that imports grpc and numpy runs the block", False)
        return
    expected = [m.group(1).strip() for m in map(PRINT_CLAIM.match, code.splitlines()) if m]
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "client", "python"),
               PYTHONDONTWRITEBYTECODE="1")
    started = time.monotonic()
    try:
        r = subprocess.run([python, "-c", code], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
        rc, out, err = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "timeout", e.stdout or "", e.stderr or ""
    check(f"{where}: the python block runs ({time.monotonic() - started:.0f} s)", rc == 0,
          f"exit {rc}\n{out}\n{err}")
    if rc == 0 and expected:
        printed = [line.strip() for line in out.splitlines()]
        check(f"  it prints what its comments say: {' | '.join(expected)}", printed == expected,
              f"printed:\n{out}")


def main(docs):
    readme_blocks = code_blocks(open(README).read())
    commands_of = [(line, logical_commands(body)) for line, lang, body, _ in readme_blocks
                   if lang in SHELL_LANGS]
    blocks_text = [body for line, lang, body, _ in readme_blocks
                   if lang in SHELL_LANGS and logical_commands(body)]
    for line, lang, _, _ in readme_blocks:
        if lang not in SHELL_LANGS:
            print(f"README.md:{line}: a ```{lang} block, not commands")
    commands_of = [(line, cmds) for line, cmds in commands_of if cmds]
    check(f"README.md has command blocks ({len(commands_of)})", len(commands_of) >= 2)
    if not commands_of:
        return
    first_line, first = commands_of[0]
    check(f"README.md:{first_line}: the first command starts the server: {first}",
          first == ["scripts/run.sh"])
    if first != ["scripts/run.sh"]:
        return

    taken = [p for p in PORTS if not port_free(p)]
    check("ports 50051 and 9464 on 127.0.0.1 are free (no other server running)", not taken,
          f"in use: {taken}")
    if taken:
        return

    log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"readme-server-{os.getpid()}.log"), "w+")
    server = subprocess.Popen(["bash", "-c", blocks_text[0]], cwd=ROOT, stdout=log,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              start_new_session=True)
    attnctl = os.path.join(ROOT, "build", "bin", "attnctl")
    serving = False
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline and server.poll() is None:
        if os.access(attnctl, os.X_OK):
            r = subprocess.run([attnctl, "--timeout_s=2", "health"], capture_output=True)
            if r.returncode == 0:
                serving = True
                break
        time.sleep(0.5)
    log.seek(0)
    server_log = log.read()
    check(f"README.md:{first_line}: `scripts/run.sh` serves (attnctl health: SERVING)", serving,
          server_log)
    check("  the server it started listens on 127.0.0.1:50051",
          "listening grpc=127.0.0.1:50051" in server_log, server_log)
    python = python_for_docs()
    # What the blocks create at the top of the repository is removed at the
    # end; what the server's start built (build/) stays.
    before = set(os.listdir(ROOT))
    try:
        if serving:
            for path in docs:
                blocks = code_blocks(open(path).read())
                if path == README:
                    first_index = next(i for i, b in enumerate(blocks)
                                       if b[1] in SHELL_LANGS and logical_commands(b[2]))
                    blocks = blocks[first_index + 1:]
                run_doc(path, blocks, python)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(DRAIN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        log.seek(0)
        check("the server drains on SIGTERM and exits 0", server.returncode == 0,
              f"exit {server.returncode}\n{log.read()}")
        log.close()
        os.unlink(log.name)
        created = sorted(set(os.listdir(ROOT)) - before)
        files = [n for n in created if not os.path.isdir(os.path.join(ROOT, n))]
        check("the commands leave no files at the top of the repository", not files,
              f"left: {', '.join(files)}")
        for name in created:
            path = os.path.join(ROOT, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        if created:
            print(f"removed what the commands wrote: {', '.join(created)}")


if __name__ == "__main__":
    docs = [os.path.abspath(d) for d in sys.argv[1:]] or \
        [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    try:
        main(docs)
    finally:
        print(f"{passed} passed, {failed} failed")
    sys.exit(0 if failed == 0 and passed > 0 else 1)
