"""Finetune BERT on the derived same-article task (the finetuning demo; the command is zoo.cli.finetune,
the task in zoo.finetune.demo_task): do two Wikipedia sentences come from the same article?

    deepspeed --num_gpus 2 finetune/same_article.py --deepspeed_config ds_configs/finetune_demo.json \
        --pretrained <BERT dir> --data-dir zoo/assets/corpora/wiki-sample.jsonl.gz --max-seq-length 128 \
        [--lr --batch-size --epochs --seed --save --wandb-project ...]
"""

from zoo.cli.finetune import main

if __name__ == "__main__":
    main("same-article")
