"""Zero-shot WikiText-103 perplexity / LAMBADA accuracy of a GPT-2 checkpoint (see zoo.eval.runner).

    python launch/evaluate.py --task wikitext --data wiki.test.tokens --load out/hf --out ppl.json
    deepspeed --num_gpus 2 launch/evaluate.py --task lambada --data lambada_test.jsonl --load out/hf \
        --tensor-parallel-size 2
    python launch/evaluate.py --task wikitext --data wiki.test.tokens --load out/hf --dtype bfloat16
    python launch/evaluate.py --task wikitext --data wiki.test.tokens --load out/hf --tf32   # float32, TF32 GEMMs

--dtype float32 (the default) computes in full float32; on an Ampere/Hopper GPU, --tf32 (TF32 tensor cores
for float32 GEMMs) or --dtype bfloat16/float16 is several times faster.
"""

from zoo.eval.runner import main

if __name__ == "__main__":
    main()
