"""Text generation from a GPT-2 or Llama checkpoint at any tensor-parallel degree (see zoo.cli.generate).

    python launch/generate.py --load out/hf --prompt "The capital of France is" --greedy
"""

from zoo.cli.generate import main

if __name__ == "__main__":
    main()
