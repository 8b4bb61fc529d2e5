"""``launch/run.py``: zoo's launcher, ``deepspeed``'s arguments exactly; returns only after every rank has exited.

    python launch/run.py --num_gpus 2 launch/pretrain.py --deepspeed_config ds_configs/cpu_demo.json
    python launch/run.py --hostfile hosts launch/pretrain.py ...      # several nodes, through pdsh

On one node with no ``--master_port`` (and no ``$MASTER_PORT``) the ranks meet on a port free at the start,
not DeepSpeed's 29500; over a hostfile the port is the one given, or DeepSpeed's. A ``--num_gpus`` or
``--num_nodes`` below 1 is refused in one sentence (exit code 2).

Exit code 75 means the run stopped early (SIGTERM, a first Ctrl-C, --exit-interval, ...) and ``latest``
names its checkpoint: run the same command with --load to go on. Any other code is DeepSpeed's runner's
(see zoo.operations.launcher). ``deepspeed --help`` lists the arguments.
"""

from __future__ import annotations

import sys

from zoo.cli.command import run_command
from zoo.operations.launcher import run, runner_arguments

HELP_FLAGS = ("-h", "--help")


def main(argv: list[str] | None = None) -> None:
    """Exit with the job's code (128 + N when the runner was killed by signal N), or 2 with one sentence
    for arguments that start nothing the user meant (``--num_gpus 0``: :func:`zoo.operations.launcher.runner_arguments`).
    ``--help`` before the script prints this command's description; after it, the script's own ``--help``
    runs under the launcher."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in HELP_FLAGS:
        print(f"usage: launch/run.py [deepspeed's arguments] SCRIPT [the script's arguments]\n\n{__doc__}")
        sys.exit(0)
    code = run(run_command(lambda: runner_arguments(argv), teardown=False))
    sys.exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
