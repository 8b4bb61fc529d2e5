"""transformers' ``LlamaConfig`` built in the spelling of the installed version, so that a reference model has
the rotary settings it is given on every transformers version setup.cfg allows."""

from __future__ import annotations

import inspect


def hf_llama_config(rope_parameters: dict, **fields):
    """``transformers.LlamaConfig(**fields)`` with the rotary settings ``rope_parameters`` (transformers 5's
    ``{"rope_type": ..., "rope_theta": ..., <scaling fields>}``) passed as the installed version takes them:
    as ``rope_parameters`` (transformers 5) or as ``rope_theta`` plus ``rope_scaling`` (transformers 4, which
    would keep an unknown ``rope_parameters`` as an inert attribute and use the default theta)."""
    import transformers

    if "rope_parameters" in inspect.signature(transformers.LlamaConfig.__init__).parameters:
        return transformers.LlamaConfig(rope_parameters=dict(rope_parameters), **fields)
    scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    return transformers.LlamaConfig(rope_theta=rope_parameters["rope_theta"],
                                    rope_scaling=scaling if scaling.get("rope_type", "default") != "default" else None,
                                    **fields)
