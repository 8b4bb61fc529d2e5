"""Export a zoo DeepSpeed checkpoint (any model family), trained at any tp degree, to a transformers directory
(see zoo.cli.export).

    python launch/export.py --load runs/demo --out runs/demo/hf [--tag iter_0000300] [--dtype float16|bfloat16|float32]
"""

from zoo.cli.export import main

if __name__ == "__main__":
    main()
