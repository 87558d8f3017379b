#!/usr/bin/env python3
"""Runs every command block of README.md as a newcomer would.

  python3 tests/readme/readme_test.py

The server is started exactly as the README's first command block says
(`scripts/run.sh`), in the background from the repository root, and the test
waits until `attnctl health` answers SERVING. Then every other command block
(```sh, ```bash, ```shell or a bare ```) runs in order, from the repository
root, in one bash each; every command in it must exit 0 (both sides of an
`a && b` too). The block that is only `scripts/test.sh` is left out: it is
what CI runs before this test. Blocks are read from README.md here, so a new
block is covered without touching this file.

Besides exit codes, what the README claims is checked where that is cheap:
  - `COMMAND  # -> TEXT`: COMMAND prints exactly TEXT;
  - `--json=PATH`: PATH is attnbench's JSON, with requests and no errors;
  - `wrote FILE.png` in a block's output: FILE.png is a PNG;
  - `cmake --install BUILD --prefix PREFIX`: PREFIX/bin/attnserve --version
    runs and PREFIX holds the CMake package.
The server is stopped with SIGTERM at the end and must drain and exit 0.
Everything listens on and talks to loopback only (the README's defaults,
127.0.0.1:50051 and 127.0.0.1:9464); the test fails at once if either port
is taken. Files and directories that the blocks create at the top of the
repository (out.json, install/, ...) are removed afterwards.

Prints one line per check and a last line "N passed, N failed".
"""
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
            print("\n".join("    " + line for line in detail.rstrip().splitlines()[-60:]), flush=True)


def code_blocks(text):
    """(line number, info string, body) of every fenced block."""
    blocks = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2), i + 1
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        blocks.append((start, lang.lower(), "\n".join(body)))
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


def main():
    blocks = [(line, lang, body) for line, lang, body in code_blocks(open(README).read())]
    commands_of = [(line, logical_commands(body)) for line, lang, body in blocks if lang in SHELL_LANGS]
    blocks_text = [body for line, lang, body in blocks if lang in SHELL_LANGS and logical_commands(body)]
    for line, lang, _ in blocks:
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
    # What the blocks create at the top of the repository is removed at the
    # end; what the server's start built (build/) stays.
    before = set(os.listdir(ROOT))
    try:
        if serving:
            for line, commands in commands_of[1:]:
                if commands == ["scripts/test.sh"]:
                    print(f"README.md:{line}: `scripts/test.sh` left out: CI runs it before this test")
                    continue
                started = time.monotonic()
                try:
                    r = subprocess.run(["bash", "-c", block_script(commands)], cwd=ROOT,
                                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, timeout=BLOCK_TIMEOUT_S)
                    rc, output = r.returncode, r.stdout
                except subprocess.TimeoutExpired as e:
                    rc, output = "timeout", (e.stdout or b"").decode(errors="replace")
                shown = re.sub(r"\s+#.*$", "", commands[0]).strip()
                shown = re.sub(r"\s+", " ", shown)
                if len(commands) > 1:
                    shown += f"` and {len(commands) - 1} more: each"
                else:
                    shown += "`"
                check(f"README.md:{line}: `{shown} exits 0 "
                      f"({time.monotonic() - started:.0f} s)", rc == 0,
                      f"exit {rc}\n{output}")
                if rc == 0:
                    claims_after(commands, output)
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
        for name in created:
            path = os.path.join(ROOT, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        if created:
            print(f"removed what the README's commands wrote: {', '.join(created)}")


if __name__ == "__main__":
    try:
        main()
    finally:
        print(f"{passed} passed, {failed} failed")
    sys.exit(0 if failed == 0 and passed > 0 else 1)
