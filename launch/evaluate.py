"""Zero-shot WikiText-103 perplexity / LAMBADA accuracy of a GPT-2 or Llama checkpoint (see zoo.cli.evaluate).

    python launch/evaluate.py --task wikitext --data wiki.test.tokens --load out/hf --out ppl.json
"""

from zoo.cli.evaluate import main

if __name__ == "__main__":
    main()
