"""Finetune BERT on SQUAD through DeepSpeed at any tp degree (see zoo.cli.finetune).

    deepspeed --num_gpus 2 finetune/squad.py --deepspeed_config ds_configs/finetune_cpu.json \
        --pretrained <BERT dir> --data-dir <SQUAD dir> [--lr --batch-size --epochs --seed --save ...]
"""

from zoo.cli.finetune import main

if __name__ == "__main__":
    main("squad")
