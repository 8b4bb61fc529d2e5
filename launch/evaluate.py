"""Zero-shot WikiText-103 perplexity / LAMBADA accuracy of a GPT-2 checkpoint (see zoo.eval.runner).

    python launch/evaluate.py --task wikitext --data wiki.test.tokens --load out/hf --out ppl.json
    deepspeed --num_gpus 2 launch/evaluate.py --task lambada --data lambada_test.jsonl --load out/hf \
        --tensor-parallel-size 2
"""

from zoo.eval.runner import main

if __name__ == "__main__":
    main()
