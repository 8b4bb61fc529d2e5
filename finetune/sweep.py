"""Run a W&B sweep grid locally: `python finetune/sweep.py finetune/sweeps/<task>-<size>.yaml [--count N] [--dry-run]`.

Each grid point is one offline W&B run (grouped by the sweep's name); prints and saves the table of
settings with the median over seeds, and a plot. The logic is in zoo.finetune.sweep.
"""

from zoo.finetune.sweep import main

if __name__ == "__main__":
    main()
