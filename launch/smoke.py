"""The acceptance run on the launched devices (see zoo.cli.smoke); exits 1 if a check failed.

    deepspeed --num_gpus N launch/smoke.py [--model gpt2-1.2b] [--seq-length 1024]
"""

import sys

from zoo.cli.smoke import main

if __name__ == "__main__":
    sys.exit(main())
