"""Smoke run: a tp=2 GPT-2 forward/backward on text from the bundled tokenizer.

    deepspeed --num_gpus 2 launch/smoke.py
"""

from zoo.training.smoke import main

if __name__ == "__main__":
    main()
