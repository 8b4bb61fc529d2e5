"""Finetune BERT on RACE through DeepSpeed at any tp degree (see zoo.cli.finetune).

    deepspeed --num_gpus 2 finetune/race.py --deepspeed_config ds_configs/finetune_cpu.json \
        --pretrained <BERT dir> --data-dir <RACE dir> [--lr --batch-size --epochs --seed --save ...]
"""

from zoo.cli.finetune import main

if __name__ == "__main__":
    main("race")
