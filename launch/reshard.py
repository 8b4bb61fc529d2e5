"""Convert a run's checkpoint to another (tp, pp, dp) layout once, on the new layout's ranks, into a new run
directory beside it (see zoo.cli.reshard).

    deepspeed --num_gpus 2 launch/reshard.py --load runs/demo --tensor-parallel-size 1 --pipeline-model-parallel-size 2
"""

from zoo.cli.reshard import main

if __name__ == "__main__":
    main()
