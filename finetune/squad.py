"""Finetune BERT on SQUAD through DeepSpeed at any tp degree (the logic is in zoo.finetune.runner).

    deepspeed --num_gpus 2 finetune/squad.py --deepspeed_config ds_configs/finetune_cpu.json \
        --pretrained <BERT dir> --data-dir <SQUAD dir> [--lr --batch-size --epochs --seed --save ...]
"""

from zoo.finetune.runner import main

if __name__ == "__main__":
    main("squad")
