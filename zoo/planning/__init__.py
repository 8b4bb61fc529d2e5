"""Planning a run before it starts: does it fit, and how long will an iteration take.

    planner.py        parameters (counted on the meta device), bytes per rank, activations, time (zoo.cli.plan)
    pipeline_plan.py  layers per pipeline stage and the 1F1B bubble
    fit_check.py      the planner's verdict for this machine's devices, before a run builds anything
    flops.py          model FLOPs of an iteration (Megatron's closed form and any family's shape)
"""
