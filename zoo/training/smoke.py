"""A tp=2 forward/backward of a tiny GPT-2 on real BPE tokens, checked against transformers."""

from __future__ import annotations

import argparse

import torch


def main(argv=None) -> None:
    import deepspeed
    import transformers

    from zoo.models import GPT2LMHeadModel, gpt2_config
    from zoo.models.gpt2 import GPT2_TOKENIZER_DIR
    from zoo.models.hf_io import hf_state_dict
    from zoo.parallel import ParallelState, model_parallel_seed

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args(argv)

    deepspeed.init_distributed(dist_backend=None)
    ps = ParallelState.initialize(args.tensor_parallel_size)
    model_parallel_seed(1234, ps)
    tokenizer = transformers.GPT2TokenizerFast.from_pretrained(str(GPT2_TOKENIZER_DIR))
    text = "Megatron-LM splits every transformer layer across GPUs with two all-reduces forward."
    ids = torch.tensor([tokenizer(text)["input_ids"]])

    config = gpt2_config("gpt2-tiny", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config, parallel=ps)
    out = model(ids, labels=ids, gather_output=True)
    out.loss.backward()

    reference = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config.to_hf_dict()))
    reference.load_state_dict(hf_state_dict(model, model.hf_param_map(), ps), strict=False)
    ref_loss = reference(ids, labels=ids).loss
    if ps.rank == 0:
        print(f"tokens: {ids.shape[1]}  tp={ps.tp_size} dp={ps.dp_size}  logits {tuple(out.logits.shape)}")
        print(f"zoo loss {out.loss.item():.6f}   transformers loss {ref_loss.item():.6f}   "
              f"|diff| {abs(out.loss.item() - ref_loss.item()):.2e}")
