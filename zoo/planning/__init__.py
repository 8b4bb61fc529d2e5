"""Planning a run before it starts: does it fit, and how long will an iteration take.

    planner.py        the plan of a run: model states, activations, pipeline stages and time per rank (zoo.cli.plan)
    model_states.py   parameters (counted on the meta device) and weights, gradients, optimizer bytes under ZeRO
    activations.py    bytes of activations a micro-batch keeps for backward (Korthikanti et al. 2022)
    gpus.py           the table of GPU peaks and memories
    plan_report.py    the readable table of launch/plan.py
    pipeline_plan.py  layers per pipeline stage and the 1F1B bubble
    context_exchange.py  context parallelism's exchanged key/value heads and all-to-all bytes per layer
    fit_check.py      the planner's verdict for this machine's devices, before a run builds anything
    flops.py          model FLOPs of an iteration (Megatron's closed form and any family's shape)
"""
