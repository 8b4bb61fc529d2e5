"""Export a zoo DeepSpeed GPT-2 checkpoint, trained at any tp degree, to a transformers directory.

    python launch/export.py --load runs/demo --out runs/demo/hf [--tag iter_0000300] [--dtype fp16|bf16|fp32]
"""

from zoo.checkpoint.deepspeed_export import main

if __name__ == "__main__":
    main()
