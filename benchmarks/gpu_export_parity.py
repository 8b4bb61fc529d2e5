"""An exported zoo run against transformers on one CUDA device: the same directory loaded by
``transformers.GPT2LMHeadModel`` and by ``zoo.models.GPT2LMHeadModel.from_pretrained``, logits and loss
on 4 x 512 tokens of this repository's README, fp32 (TF32 off) and under bf16 autocast. Prints; asserts
nothing (the CPU suite asserts the same parity, tests/test_hf_roundtrip.py).

    python benchmarks/gpu_export_parity.py runs/gpu-fp16/hf
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers

from zoo.assets import GPT2_TOKENIZER_DIR
from zoo.models import GPT2LMHeadModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    if len(sys.argv) != 2 or not torch.cuda.is_available():
        sys.exit("usage: python benchmarks/gpu_export_parity.py EXPORTED_DIR   (needs a CUDA device)")
    directory = sys.argv[1]
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tokenizer = transformers.AutoTokenizer.from_pretrained(GPT2_TOKENIZER_DIR)
    with open(os.path.join(ROOT, "README.md")) as handle:
        tokens = tokenizer(handle.read())["input_ids"][:4 * 512]
    ids = torch.tensor(tokens).view(4, 512).cuda()
    reference = transformers.GPT2LMHeadModel.from_pretrained(directory, dtype=torch.float32).cuda().eval()
    model = GPT2LMHeadModel.from_pretrained(directory).cuda().eval()
    with torch.no_grad():
        for name, autocast in (("fp32", False), ("bf16 autocast", True)):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                expected = reference(ids, labels=ids)
                got = model(ids, labels=ids, gather_output=True)
            print(f"{name:>13}: logits rel err {relative(got.logits, expected.logits):.2e}, loss transformers "
                  f"{expected.loss.item():.6f} zoo {got.loss.item():.6f}")


if __name__ == "__main__":
    main()
