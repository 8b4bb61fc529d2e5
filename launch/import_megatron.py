"""Import a Megatron-LM GPT checkpoint (any tp and pp) into a transformers GPT-2 directory (see
zoo.cli.import_megatron).

    python launch/import_megatron.py --load <megatron checkpoint dir> --out <hf dir> [--iteration N]
"""

from zoo.cli.import_megatron import main

if __name__ == "__main__":
    main()
