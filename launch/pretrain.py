"""Pretrain GPT-2 with Megatron tensor parallelism under DeepSpeed.

    deepspeed --num_gpus 8 launch/pretrain.py --deepspeed_config ds_configs/tp8.json [--train-iters N ...]
    deepspeed --num_gpus 2 launch/pretrain.py --deepspeed_config ds_configs/cpu_demo.json   # CPU, gloo
"""

from zoo.training.pretrain import main

if __name__ == "__main__":
    main()
