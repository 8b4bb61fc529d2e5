"""zoo's launcher: DeepSpeed's ``deepspeed`` runner, waited for to the last rank, on one node or many.

    python launch/run.py --num_gpus 2 launch/pretrain.py --deepspeed_config ds_configs/cpu_demo.json
    python launch/run.py --hostfile hosts launch/pretrain.py ...             # many nodes, through pdsh

(the command is :mod:`zoo.cli.run`, also ``python -m zoo.cli.run`` with the same arguments) takes exactly
``deepspeed``'s arguments and runs DeepSpeed's runner as its child, in a process group of its own. What
it adds is what a scheduler that waits on the job's first process needs:

* SIGTERM to the job's whole process group (a batch system, a supervisor) makes the plain ``deepspeed``
  command return at once (rc -15) while the ranks are still writing their checkpoint. This launcher is a
  child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``): every process of the job on this node that loses
  its parent becomes its child, and it returns only after every one of them has exited. It waits
  without limit while the runner, a per-node launcher or a rank lives (a rank may be writing its
  checkpoint); what outlives the last of them (a W&B service, a stuck DataLoader worker) gets
  :data:`ORPHAN_GRACE_S` (30 s), then SIGKILL, named in one line on stderr;
* a SIGTERM, SIGINT or SIGUSR1 sent to this process (or its group, or a Ctrl-C: the runner's own group
  does not get it) reaches exactly this job's ranks: those on this node (the processes DeepSpeed's
  per-node launcher started) as that signal (SIGINT as SIGINT, so a second Ctrl-C is the immediate stop),
  and every rank on every node as a stop request through the launcher's store (:mod:`zoo.operations.stop_report`).
  They stop at the next iteration boundary with a checkpoint. The runner itself is never sent SIGTERM or
  SIGINT once it started pdsh: its handler would run DeepSpeed's kill command, ``pdsh ... pkill -f
  '<python> -u -m deepspeed.launcher.launch'``, which kills every DeepSpeed launcher of that Python on
  every node, other jobs' included; the runner ends when its ranks have. Before any rank or per-node
  launcher exists on this node, and before the runner started anything, every process of the job gets
  SIGTERM instead;
* when the runner exits (``kill -9``) while processes of the job remain, the ranks are asked to stop;
* its exit code says how the job ended:

  - :data:`STOPPED_AND_CHECKPOINTED` (75, ``EX_TEMPFAIL`` of sysexits.h): the run stopped before its last
    iteration (a signal, its launcher's exit, ``--exit-interval``, ``--exit-duration-in-mins``) and
    ``latest`` names the checkpoint of that stop: resubmit with ``--load`` the same run directory. Only
    when the runner's code agrees (:func:`stopped_cleanly`): 0, or death by a signal (SIGTERM, or the
    SIGINT of a Ctrl-C); a rank that fails after the report was written (the final barrier, teardown)
    gets its failure code, with a line saying the checkpoint is there;
  - otherwise the runner's own code (0 when the run finished; DeepSpeed's code of a failed rank, 2 for a
    user error; 128 + N when the runner itself was killed by signal N).

Before starting the runner, :func:`runner_arguments` checks the counts (a ``--num_gpus`` or ``--num_nodes``
that is not positive is one sentence, exit code 2, where DeepSpeed would silently start one rank per node
or use every node) and gives a launch on this node alone that names no ``--master_port`` the port in
``$MASTER_PORT``, else one free now, rather than DeepSpeed's 29500.

The ranks find the launcher's store in ``$ZOO_LAUNCHER_STORE`` (``host:port``; the host is
``$ZOO_LAUNCHER_ADDR`` when set, else this node's address on the route to ``--master_addr``, else its host
name), which reaches other nodes through DeepSpeed's environment file: the launcher points ``DS_ENV_FILE``
at a copy of the user's ``.deepspeed_env`` files (``~`` and ``.``) with that variable added. Every rank
reports a stop with a checkpoint there once ``latest`` names it; ``$ZOO_LAUNCHER_PID`` names this process
to the ranks of this node (:mod:`zoo.operations.launcher_watch`), so that killing it (even with SIGKILL) also stops
them; ranks on other nodes see the store's connection fail.

Under SLURM, one launcher runs on each node (``--no_ssh --node_rank R``, launch/slurm_pretrain.sbatch):
each waits for its node's ranks and returns 75 after their clean stop, so the step ends only then.
DeepSpeed's per-node launcher, when it gets SIGTERM itself (SLURM signals every process of the step),
gives its ranks 30 s to exit and then kills them; a stop whose checkpoint takes longer needs the signal
sent to this process alone (``scancel --signal=TERM --batch``, ``kill <pid>``).
"""

from __future__ import annotations

import ctypes
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from zoo.errors import UserError
from zoo.operations.launcher_watch import LAUNCHER_PID_VARIABLE, command_line, parent_of, runs_module
from zoo.operations.stop_report import STORE_VARIABLE, read_stop_report, request_stop, serve

__all__ = ["run", "runner_arguments", "wait_for_job", "stopped_cleanly", "STOPPED_AND_CHECKPOINTED",
           "ORPHAN_GRACE_S"]

STOPPED_AND_CHECKPOINTED = 75          # EX_TEMPFAIL: stopped early, checkpointed; run it again to go on
PR_SET_CHILD_SUBREAPER = 36
PER_NODE_LAUNCHER = "deepspeed.launcher.launch"
RUNNER_COMMAND = (sys.executable, "-m", "deepspeed.launcher.runner")
ORPHAN_GRACE_S = 30.0     # what a process of the job may outlive the last rank by (a W&B service's upload)
POLL_S = 0.5               # a rank lives far longer than this: it is seen under its per-node launcher
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
ADDRESS_VARIABLE = "ZOO_LAUNCHER_ADDR"   # the address other nodes reach this launcher's store at
DEEPSPEED_ENV_NAME = ".deepspeed_env"   # DeepSpeed's runner exports its lines to every node (DS_ENV_FILE)
PORT_VARIABLE = "MASTER_PORT"           # the rendezvous port a one-node launch takes when it names none
# DeepSpeed's runner's counts: (its attribute, the flags that set it, what a positive value means, the default's
# meaning). DeepSpeed reads any value below 1 as its default.
COUNTS = (("num_gpus", ("--num_gpus", "--num_accelerators"), "the ranks to start on each node",
           "one rank per accelerator"),
          ("num_nodes", ("--num_nodes",), "the nodes of the hostfile to use", "every node"))


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux); False where that is not possible."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def descendants(root: int) -> list[int]:
    """The pids of every process below ``root``, from ``/proc`` (one pass over the process table)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            parent = parent_of(int(entry.name))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry.name))
    found, frontier = [], [root]
    while frontier:
        below = children.get(frontier.pop(), [])
        found.extend(below)
        frontier.extend(below)
    return found


def process_start(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat``): with the pid, it names one
    process even after the pid is reused. None when ``pid`` no longer exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])


def is_per_node_launcher(pid: int) -> bool:
    """Whether ``pid`` is DeepSpeed's per-node launcher (``python -m deepspeed.launcher.launch``); pdsh and
    ssh, which carry its command line as their arguments, are not."""
    return runs_module(command_line(pid), PER_NODE_LAUNCHER)


def ranks_of(root: int, job: list[int] | None = None) -> list[int]:
    """The ranks below ``root`` on this node: the processes whose parent is DeepSpeed's per-node launcher.
    ``job`` is :func:`descendants` of ``root`` when the caller has it (one pass over the process table)."""
    job = descendants(root) if job is None else job
    launchers = {pid for pid in job if is_per_node_launcher(pid)}
    return [pid for pid in job if parent_of(pid) in launchers]


def forward_to_ranks(signum: int, runner: subprocess.Popen | None, store) -> None:
    """Stop exactly this job's ranks cleanly for ``signum``: a stop request through ``store`` (every rank,
    every node) and ``signum`` to the ranks of this node. Before any rank or per-node launcher exists here
    there is nothing to checkpoint on this node: every process of the job gets SIGTERM, unless the runner
    has started a multi-node launch (pdsh), whose handler would run DeepSpeed's kill command; the request
    then stops the ranks as they come up, and the runner ends with them. ``runner`` is None while it is
    being started."""
    request_stop(store, f"signal {signal.Signals(signum).name}")
    job = descendants(os.getpid())
    targets = ranks_of(os.getpid(), job)
    if not targets:
        remote = runner is not None and any(parent_of(pid) == runner.pid and not is_per_node_launcher(pid)
                                            for pid in job)
        targets, signum = ([] if remote else job), signal.SIGTERM
    for pid in targets:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def reap_finished(statuses: dict[int, int]) -> bool:
    """Reap every child of this process that has exited, recording its exit code (negative: killed by
    that signal) in ``statuses``; False once this process has no child left at all."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True
        statuses[pid] = os.waitstatus_to_exitcode(status)


def kill_orphans(job: list[int], grace_s: float) -> None:
    """SIGKILL the processes ``job`` still holds once no rank is left, and say so in one line."""
    named = []
    for pid in job:
        name = " ".join(command_line(pid))[:80]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        named.append(f"pid {pid} ({name})")
    if named:
        print(f"zoo launcher: killed {len(named)} process(es) of the job still running {grace_s:g} s after its "
              f"last rank exited: {', '.join(named)}", file=sys.stderr, flush=True)


def wait_for_job(runner: subprocess.Popen, orphan_grace_s: float = ORPHAN_GRACE_S, store=None) -> int:
    """Wait for the runner and every process of the job (as a subreaper, orphaned descendants are this
    process's children); the runner's exit code.

    While the runner, a per-node launcher or a rank (a process seen as a child of a per-node launcher,
    identified by pid and start time) lives, it waits without limit: a rank may be writing its
    checkpoint. When the runner has exited and processes of the job remain, every rank is asked to stop
    through ``store`` (when given). Processes left after that (a W&B service, a stuck DataLoader worker,
    pdsh and ssh of ranks on other nodes that stopped) get ``orphan_grace_s``, then SIGKILL
    (:func:`kill_orphans`)."""
    statuses: dict[int, int] = {}
    ranks: set[tuple[int, int | None]] = set()
    idle_since: float | None = None
    while reap_finished(statuses):
        job = descendants(os.getpid())
        ranks.update((pid, process_start(pid)) for pid in ranks_of(os.getpid(), job))
        if runner.pid in statuses and store is not None:
            request_stop(store, f"the exit of the launcher (pid {runner.pid}, deepspeed)")
        holding = runner.pid not in statuses or any(
            is_per_node_launcher(pid) or (pid, process_start(pid)) in ranks for pid in job)
        if holding:
            idle_since = None
        elif idle_since is None:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since >= orphan_grace_s:
            kill_orphans(job, orphan_grace_s)
            idle_since = None
        time.sleep(POLL_S)
    code = statuses.get(runner.pid, runner.returncode)
    runner.returncode = code
    return code


def run(argv: list[str], runner_command: Sequence[str] = RUNNER_COMMAND,
        orphan_grace_s: float = ORPHAN_GRACE_S) -> int:
    """Run DeepSpeed's runner (``runner_command``, the program and its first arguments) on ``argv``
    (``deepspeed``'s arguments), wait for every process of the job and return the exit code documented
    in the module."""
    become_subreaper()
    store = serve()
    address = f"{launcher_address(argv)}:{store.port}"
    with tempfile.TemporaryDirectory(prefix="zoo-launcher-") as scratch:
        env = dict(os.environ, **{STORE_VARIABLE: address, LAUNCHER_PID_VARIABLE: str(os.getpid()),
                                  "DS_ENV_FILE": str(deepspeed_env_file(Path(scratch), {STORE_VARIABLE: address}))})
        started: list[subprocess.Popen] = []
        previous = {signum: signal.signal(signum, lambda signum, frame: forward_to_ranks(
            signum, started[0] if started else None, store)) for signum in FORWARDED}
        try:
            started.append(subprocess.Popen([*runner_command, *argv], env=env, process_group=0))
            runner_code = wait_for_job(started[0], orphan_grace_s, store)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
    stopped = read_stop_report(store)
    if stopped is not None and stopped_cleanly(runner_code):
        print(f"zoo launcher: the run stopped by {stopped['stopped_by']} after iteration {stopped['iteration']} "
              f"with a checkpoint; exit code {STOPPED_AND_CHECKPOINTED}", file=sys.stderr, flush=True)
        return STOPPED_AND_CHECKPOINTED
    if stopped is not None:
        print(f"zoo launcher: the run saved a checkpoint after iteration {stopped['iteration']} when stopped by "
              f"{stopped['stopped_by']}, but then failed; exit code {runner_code} (DeepSpeed's runner's)",
              file=sys.stderr, flush=True)
    return runner_code


def launcher_address(argv: Sequence[str], environ: dict[str, str] | None = None) -> str:
    """The address the ranks reach this launcher at: ``$ZOO_LAUNCHER_ADDR``; else this node's address on
    the route to the runner's ``--master_addr`` (loopback for a local master); else the host name."""
    environ = os.environ if environ is None else environ
    if environ.get(ADDRESS_VARIABLE):
        return environ[ADDRESS_VARIABLE]
    master = option_value(argv, "--master_addr")
    if master is not None:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((master, 9))       # a UDP connect sends nothing: it only picks the route
                return probe.getsockname()[0]
        except OSError:
            pass
    return socket.gethostname()


def option_value(argv: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` (``--flag V`` or ``--flag=V``) among the runner's own arguments, before the
    script."""
    for index, arg in enumerate(argv):
        if arg == flag and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
        if not arg.startswith("-") and (index == 0 or not argv[index - 1].startswith("--")):
            return None                          # the user's script: its arguments are not the runner's
    return None


def deepspeed_env_file(directory: Path, extra: dict[str, str], environ: dict[str, str] | None = None) -> Path:
    """A file for ``DS_ENV_FILE``: the lines of the environment files DeepSpeed's runner would read (the
    name in ``$DS_ENV_FILE`` or ``.deepspeed_env``, in ``~`` and in the current directory), then ``extra``.
    DeepSpeed exports its lines to every node of a multi-node launch."""
    environ = os.environ if environ is None else environ
    name = environ.get("DS_ENV_FILE", DEEPSPEED_ENV_NAME)
    lines: list[str] = []
    seen: set[str] = set()
    for folder in (os.path.expanduser("~"), "."):
        path = os.path.realpath(os.path.join(folder, name))
        if path not in seen and os.path.isfile(path):
            seen.add(path)
            lines += [line.rstrip("\n") for line in Path(path).read_text().splitlines() if line.strip()]
    lines += [f"{key}={value}" for key, value in extra.items()]
    target = directory / "deepspeed_env"
    target.write_text("".join(line + "\n" for line in lines))
    return target


def stopped_cleanly(runner_code: int) -> bool:
    """Whether the job ended as its stop report says, given the runner's exit code: 0 (every rank
    exited 0), or negative: the runner itself died by a signal (SIGTERM from a batch system that signals
    every process; or SIGINT, of which Python re-raises an unhandled KeyboardInterrupt). A positive code
    is a rank that failed after the report was written (the final barrier, teardown)."""
    return runner_code <= 0


def runner_arguments(argv: Sequence[str], environ: dict[str, str] | None = None) -> list[str]:
    """``argv`` (``deepspeed``'s arguments) as this launcher hands them to DeepSpeed's runner: the counts
    checked (:func:`check_counts`) and, for a one-node launch, the rendezvous port named
    (:func:`with_rendezvous_port`). A UserError (one sentence) for a value the user must change; what
    DeepSpeed's own parser refuses is its usage message and exit code 2, as under ``deepspeed``."""
    from deepspeed.launcher.runner import parse_args  # local: DeepSpeed's import cost, paid by the CLI only

    parsed = parse_args(list(argv))
    own = list(argv[:len(argv) - len(parsed.user_args) - 1])     # what comes before the user's script
    check_counts(parsed, own)
    if given(own, "--master_port"):
        check_port(parsed.master_port)
    if os.path.isfile(parsed.hostfile):
        check_hostfile(parsed.hostfile)
    return with_rendezvous_port(argv, parsed, own, environ)


def check_port(port: int) -> None:
    """A UserError (one sentence) for a ``--master_port`` that is no TCP port the ranks can meet on: 0 would
    let each rank's store bind a port of its own, so the ranks would wait for each other forever."""
    if not 0 < port < 65536:
        raise UserError(f"--master_port {port} is not a TCP port the ranks can meet on: give a number from 1 to "
                         "65535, or leave --master_port out and zoo's launcher picks a free port.")


def check_hostfile(path: str) -> None:
    """A UserError (one sentence naming the file, the line and the fix) for a hostfile DeepSpeed's runner would
    end in a traceback on, or start nothing from: each line not blank and no ``#`` comment is ``HOST slots=N``
    with N a count from 1 up, each host once, at least one host."""
    hosts = set()
    form = "write each node as 'HOST slots=N', e.g. 'worker-1 slots=4' (# starts a comment)"
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"--hostfile {path} cannot be read ({getattr(err, 'strerror', None) or err}); pass a "
                         f"readable text file, one line per node: {form}.") from None
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"(\S+)\s+slots=(\S*)", line)
        if match is None:
            raise UserError(f"line {number} of hostfile {path}, {line!r}, names no slots; {form}.")
        host, slots = match.groups()
        if not slots.isdigit() or int(slots) < 1:
            raise UserError(f"line {number} of hostfile {path} gives {host} slots={slots}, not a count of ranks; "
                             f"{form}, with N a number from 1 up.")
        if host in hosts:
            raise UserError(f"line {number} of hostfile {path} names {host} a second time; give each node one line.")
        hosts.add(host)
    if not hosts:
        raise UserError(f"hostfile {path} names no node; {form}, or leave --hostfile out to run on this node only.")


def given(own: Sequence[str], *flags: str) -> bool:
    """Whether the runner's own arguments ``own`` carry one of ``flags`` (``--flag V`` or ``--flag=V``)."""
    return any(arg.split("=", 1)[0] in flags for arg in own if arg.startswith("--"))


def check_counts(parsed, own: Sequence[str]) -> None:
    """A UserError (one sentence) for a ``--num_gpus`` or ``--num_nodes`` given below 1: DeepSpeed would
    read it as its default (one rank per accelerator, every node) without a word, so ``--num_gpus 0``
    would start a rank."""
    for attribute, flags, meaning, default in COUNTS:
        value = getattr(parsed, attribute)
        if value < 1 and (value != -1 or given(own, *flags)):
            raise UserError(f"{flags[0]} {value} is not a count: give {meaning} as a number from 1 up, or leave "
                             f"{flags[0]} out for DeepSpeed's default ({default})")


def with_rendezvous_port(argv: Sequence[str], parsed, own: Sequence[str],
                         environ: dict[str, str] | None = None) -> list[str]:
    """``argv``, with ``--master_port`` first when the launch runs on this node alone (DeepSpeed finds no
    hostfile) and names no port: ``$MASTER_PORT`` when set, else a port free now. DeepSpeed's default,
    29500, is taken by the first job of the machine that used it; a second job's ranks would fail to
    rendezvous. A launch over a hostfile keeps the port given or DeepSpeed's: every node's launcher must
    name the same one."""
    environ = os.environ if environ is None else environ
    if given(own, "--master_port") or os.path.isfile(parsed.hostfile):
        return list(argv)
    port = environ.get(PORT_VARIABLE) or str(free_port())
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"{PORT_VARIABLE}={port} is not a TCP port: set it to a number from 1 to 65535, or unset "
                         f"it to let zoo's launcher pick a free port")
    return ["--master_port", port, *argv]


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel hands to outgoing connections (Linux's ip_local_port_range; IANA's elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def free_port() -> int:
    """A loopback port free now and outside the ephemeral range. A port from ``bind(0)`` is an ephemeral one:
    in the seconds before a launched job binds it, the kernel may give it to any outgoing connection on the
    machine (a gloo pair, a store client) as its source port, and the job then fails to bind its rendezvous.
    Ports below the ephemeral range are only ever taken by an explicit bind."""
    low, _ = ephemeral_port_range()
    candidates = list(range(max(1024, low - 12000), low))
    random.SystemRandom().shuffle(candidates)
    for port in candidates[:200]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:   # all tried were taken: any free port
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
