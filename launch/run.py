"""zoo's launcher: ``deepspeed``'s arguments, exactly; returns only after every rank has exited (see zoo.cli.run).

    python launch/run.py --num_gpus 2 launch/pretrain.py --deepspeed_config ds_configs/cpu_demo.json
"""

from zoo.cli.run import main

if __name__ == "__main__":
    main()
