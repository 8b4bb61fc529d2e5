"""Run a W&B sweep grid locally, no YAML editing needed:

    python finetune/sweep.py finetune/sweeps/<task>-<size>.yaml --pretrained <BERT dir> [--data-dir DIR|hub:NAME]
        [--deepspeed-config FILE] [--project P] [--entity E] [--count N] [--out DIR] [--overwrite] [--dry-run]

Each grid point is one W&B run (offline unless WANDB_MODE says otherwise; grouped by the sweep's name) in its
own directory under --out; prints and saves the table of settings with the median over seeds, and a plot.
The logic is in zoo.finetune.sweep.
"""

from zoo.finetune.sweep import main

if __name__ == "__main__":
    main()
