"""A run's configuration, read before torch is imported, so ``--help`` and a bad config cost no import time.

    run_config.py          RunConfig: every setting of a pretraining run, its flag and zoo-block key, and the parser
    loading.py             load_run_config: the ds_config file, its zoo block and the flags over both, checked
    validation.py          the checks of a RunConfig, alone and against the world size, and its warnings
    ds_config_file.py      reading a ``--deepspeed_config`` file and checking its DeepSpeed part
    deepspeed_dict.py      the dict handed to deepspeed.initialize and the LR schedule a checkpoint records
    deepspeed_overrides.py the DeepSpeed keys a flag or a schedule overrides
"""
