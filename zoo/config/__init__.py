"""A run's configuration: the ds_config's ``"zoo"`` block and the Megatron-style flags over it
(:mod:`.run_config`, one :class:`~zoo.config.run_config.RunConfig`), and the DeepSpeed keys a flag or a
schedule overrides (:mod:`.deepspeed_overrides`). Read before torch is imported, so ``--help`` and a bad
config cost no import time."""
