"""Does a config fit, and how long will an iteration take? Per-rank memory and seconds per iteration, from
the ds_config alone (see zoo.cli.plan).

    python launch/plan.py --deepspeed_config ds_configs/tp8.json --num-gpus 8 [--gpu V100] [--json]
"""

from zoo.cli.plan import main

if __name__ == "__main__":
    main()
