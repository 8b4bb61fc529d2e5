"""zoo's launcher: ``deepspeed``'s arguments, exactly; returns only after every rank has exited.

    python launch/run.py --num_gpus 2 launch/pretrain.py --deepspeed_config ds_configs/cpu_demo.json

Exit code 75 means the run stopped early (SIGTERM, a first Ctrl-C, --exit-interval, ...) and ``latest``
names its checkpoint: run the same command with --load to go on. Any other code is DeepSpeed's runner's.
See zoo/launcher.py.
"""

from zoo.launcher import main

if __name__ == "__main__":
    main()
