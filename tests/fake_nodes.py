"""Several "nodes" on one machine, reached through real pdsh and an sshd-like ``ssh`` (see DESIGN.md,
"Simulating a cluster on one machine").

:func:`start_nodes` starts a fake sshd: a daemon in its own session, outside the job's process tree, that
runs each remote command as sshd does: ``bash -c COMMAND`` in a new session (``setsid``), with the
daemon's environment (not the client's), its stdout and stderr relayed through a connection to the
``ssh`` client. The ``ssh`` first on the job's PATH is that client. What sshd does when the client goes
away is reproduced: the daemon closes its ends of the command's output pipes, so the command's next write
fails with EPIPE (SIGPIPE), and nothing signals the command itself. The client goes away when it is killed,
and, like OpenSSH's, when its own output fails (its reader, pdsh, is gone: OpenSSH then closes the
channel); otherwise it returns the command's exit code (255 for a command killed by a signal).

Every node's processes are the daemon's descendants, so the ``pkill`` first on the remote PATH sees only
them, as pkill on a real node sees only that node: DeepSpeed's kill command (``pdsh ... pkill -f``) hits
this simulation's processes, never another job running on the machine.

The hostfile names two nodes, ``localhost`` and ``127.0.0.1`` (``slots`` each); they share every directory, as
nodes share Lustre or NFS.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PDSH = shutil.which("pdsh")
NODES = ("localhost", "127.0.0.1")   # two names pdsh resolves on any machine, both loopback
SUITE_TOOLS = ("ninja",)            # resolved as the rest of the suite resolves them (_suite_tools)

SSHD = r'''
import json, os, selectors, socket, struct, subprocess, sys, threading

def send(conn, channel, data):
    conn.sendall(struct.pack("!BI", channel, len(data)) + data)

def session(conn):
    header = b""
    while not header.endswith(b"\n"):
        chunk = conn.recv(1)
        if not chunk:
            return
        header += chunk
    command = json.loads(header)["command"]
    child = subprocess.Popen(["bash", "-c", command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True)
    pipes = {child.stdout.fileno(): 1, child.stderr.fileno(): 2}
    selector = selectors.DefaultSelector()
    for fd in pipes:
        selector.register(fd, selectors.EVENT_READ)
    selector.register(conn, selectors.EVENT_READ)
    client_gone = False
    while pipes and not client_gone:
        for key, _ in selector.select():
            if key.fileobj is conn:
                client_gone = not conn.recv(4096)
                continue
            data = os.read(key.fileobj, 65536)
            if not data:
                selector.unregister(key.fileobj)
                del pipes[key.fileobj]
                continue
            try:
                send(conn, pipes[key.fileobj], data)
            except OSError:
                client_gone = True
    child.stdout.close()          # the client is gone or the command closed its output: so is the channel
    child.stderr.close()
    code = child.wait()
    if not client_gone:
        try:
            send(conn, 3, struct.pack("!i", code))
        except OSError:
            pass
    conn.close()

os.environ["FAKE_SSHD_PID"] = str(os.getpid())    # the node's pkill sees only the daemon's descendants
server = socket.socket(socket.AF_UNIX)
server.bind(sys.argv[1])
server.listen(64)
open(sys.argv[1] + ".ready", "w").close()
while True:
    conn, _ = server.accept()
    threading.Thread(target=session, args=(conn,), daemon=True).start()
'''

SSH = r'''#!{python}
import json, os, socket, struct, sys
WITH_VALUE = set("bcDEeFIiJLlmOopQRSWw")
args, i = sys.argv[1:], 0
while i < len(args) and args[i].startswith("-"):
    i += 2 if args[i][1:2] in WITH_VALUE and len(args[i]) == 2 else 1
host, command = args[i], " ".join(args[i + 1:])
conn = socket.socket(socket.AF_UNIX)
conn.connect({socket_path!r})
conn.sendall(json.dumps({{"host": host, "command": command}}).encode() + b"\n")
streams = {{1: sys.stdout.buffer, 2: sys.stderr.buffer}}
buffer = b""
while True:
    chunk = conn.recv(65536)
    if not chunk:
        sys.exit(255)                                   # the connection dropped
    buffer += chunk
    while len(buffer) >= 5:
        channel, size = struct.unpack("!BI", buffer[:5])
        if len(buffer) < 5 + size:
            break
        data, buffer = buffer[5:5 + size], buffer[5 + size:]
        if channel == 3:
            code = struct.unpack("!i", data)[0]
            sys.exit(255 if code < 0 else code)          # a command killed by a signal: 255, as OpenSSH's
        try:
            streams[channel].write(data)
            streams[channel].flush()
        except OSError:          # its reader (pdsh) is gone: OpenSSH's client then closes the channel
            sys.exit(255)
'''

PKILL = r'''#!{python}
import os, re, signal, sys
pattern = re.compile(sys.argv[-1])
root = int(os.environ["FAKE_SSHD_PID"])

def parent(pid):
    try:
        stat = open(f"/proc/{{pid}}/stat").read()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])

def on_this_node(pid):
    while pid not in (None, 0, 1):
        if pid == root:
            return True
        pid = parent(pid)
    return False

found = 1
for entry in os.listdir("/proc"):
    if not entry.isdigit() or int(entry) == os.getpid() or not on_this_node(int(entry)):
        continue
    try:
        cmdline = open(f"/proc/{{entry}}/cmdline", "rb").read().replace(b"\0", b" ").decode().strip()
    except OSError:
        continue
    if pattern.search(cmdline):
        try:
            os.kill(int(entry), signal.SIGTERM)
            found = 0
        except ProcessLookupError:
            pass
sys.exit(found)
'''


@dataclass
class Nodes:
    """The simulated nodes: the hostfile, the PATH to give the job (fake ssh first) and the daemon."""

    hostfile: Path
    path: str
    sshd: subprocess.Popen

    def job_env(self, **extra: str) -> dict[str, str]:
        """The environment of a job started on the head node (the first node)."""
        return dict(os.environ, PATH=self.path, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1",
                    **extra)

    def close(self) -> None:
        """End the daemon and every process still running on the nodes."""
        import psutil

        try:
            left = psutil.Process(self.sshd.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            left = []
        for process in left:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        self.sshd.kill()
        self.sshd.wait()


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def start_nodes(root: Path, slots: int = 1) -> Nodes:
    """Start the fake sshd under ``root`` and write the two nodes' hostfile (``slots`` ranks each)."""
    client_bin, node_bin = root / "head-bin", root / "node-bin"
    client_bin.mkdir(parents=True)
    node_bin.mkdir()
    socket_path = str(root / "sshd.sock")
    if len(socket_path) > 100:                      # AF_UNIX paths are short
        socket_path = os.path.join("/tmp", f"zoo-sshd-{os.getpid()}-{time.monotonic_ns()}.sock")
    _executable(client_bin / "ssh", SSH.format(python=sys.executable, socket_path=socket_path))
    _executable(node_bin / "pkill", PKILL.format(python=sys.executable))
    hostfile = root / "hostfile"
    hostfile.write_text("".join(f"{node} slots={slots}\n" for node in NODES))
    node_env = dict(os.environ, PATH=f"{node_bin}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1",
                    GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1")
    sshd = subprocess.Popen([sys.executable, "-c", SSHD, socket_path], env=node_env, cwd=root,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    sshd_env_ready(sshd, socket_path)
    venv_bin = os.path.dirname(sys.executable)        # as in an activated virtual environment
    suite_tools = _suite_tools(root / "suite-bin")
    return Nodes(hostfile, os.pathsep.join([str(client_bin), suite_tools, venv_bin, os.environ["PATH"]]), sshd)


def _suite_tools(folder: Path) -> str:
    """``folder``, holding links to the :data:`SUITE_TOOLS` this process finds on its PATH, to go before the
    virtual environment's bin on the job's PATH.

    That bin may hold another ninja (the ``ninja`` wheel, 1.13) than the one the rest of the suite runs
    (e.g. /usr/bin/ninja 1.11). Two ninja versions hash build commands differently, so each rebuilds the
    DeepSpeed JIT ops in ~/.cache/torch_extensions that the other built (deepspeed_shm_comm: about 50 s on 2
    cores, in every rank's set-up). With these links first, the job's ranks load the build the suite made."""
    folder.mkdir()
    for tool in SUITE_TOOLS:
        found = shutil.which(tool)
        if found is not None:
            (folder / tool).symlink_to(found)
    return str(folder)


def sshd_env_ready(sshd: subprocess.Popen, socket_path: str, timeout_s: float = 30) -> None:
    """Wait until the daemon listens."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(socket_path + ".ready"):
        assert sshd.poll() is None and time.monotonic() < deadline, "the fake sshd did not start"
        time.sleep(0.02)
