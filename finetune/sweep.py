"""Run a W&B sweep grid locally, no YAML editing needed (see zoo.cli.sweep):

    python finetune/sweep.py finetune/sweeps/<task>-<size>.yaml --pretrained <BERT dir> [--data-dir DIR|hub:NAME]
"""

from zoo.cli.sweep import main

if __name__ == "__main__":
    main()
