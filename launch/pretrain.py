"""Pretrain any zoo model family with Megatron tensor parallelism under DeepSpeed (see zoo.cli.pretrain).

    deepspeed --num_gpus 8 launch/pretrain.py --deepspeed_config ds_configs/tp8.json [--train-iters N ...]
"""

from zoo.cli.pretrain import main

if __name__ == "__main__":
    main()
