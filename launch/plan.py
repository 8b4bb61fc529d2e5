"""Does a config fit, and how long will an iteration take? Per-rank memory (weights, gradients, optimizer,
activations) and seconds per iteration, from the ds_config alone (no GPU, no process group).

    python launch/plan.py --deepspeed_config ds_configs/tp8.json --num-gpus 8 [--num-nodes 1]
        [--gpu V100|A100|H100|H200|cpu] [--gpu-memory 32GB] [--mfu 0.4] [--json]
"""

from zoo.training.planner import main

if __name__ == "__main__":
    main()
