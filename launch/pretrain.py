"""Pretrain GPT-2 or BERT with Megatron tensor parallelism under DeepSpeed.

    deepspeed --num_gpus 8 launch/pretrain.py --deepspeed_config ds_configs/tp8.json [--train-iters N ...]
    deepspeed --num_gpus 2 launch/pretrain.py --deepspeed_config ds_configs/cpu_demo.json   # CPU, gloo

Start from transformers-layout weights (any tp; the directory's model_type must match the preset's family):

    deepspeed --num_gpus 4 launch/pretrain.py --deepspeed_config ds_configs/tp4.json --pretrained out/hf

Resume with --load RUN_DIR, also at another --tensor-parallel-size than the checkpoint's: it is resharded
once into RUN_DIR/checkpoints/resharded/<tag>-tp<N>/ and loaded from there.
"""

from zoo.inference import sample_lines
from zoo.training.pretrain import main

if __name__ == "__main__":
    main(sample_text=sample_lines)   # end-of-run samples of a zoo block's sample_prompts
