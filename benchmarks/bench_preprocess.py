"""Preprocessing throughput: zoo against a Megatron-style peer, at 1 and 2 workers (printed, never asserted).

The corpus is the bundled Wikipedia sample (zoo/assets/corpora) repeated into one JSON-lines file of at
least ``--size-mb`` MB under ``--work-dir`` (default /tmp/zoo-bench-preprocess; reused when present).
Both harnesses tokenize it with the same GPT-2 fast tokenizer, append <|endoftext|> to each document and
write one ``.bin/.idx``; each run is its own Python process, timed from the start of its work to the
committed output, with the tokenizer's own threads off so that ``--workers`` alone sets the cores used.

- **zoo**: :func:`zoo.data.preprocess` (``datasets`` reads the file, workers tokenize batches of documents
  in one call each, the main process writes).
- **peer**: the logic of Megatron-LM's ``tools/preprocess_data.py`` as it documents it, written here: a
  ``multiprocessing.Pool`` whose initializer builds one tokenizer per worker, ``imap`` over the raw lines
  with ``chunksize`` 32, an encoder that parses one JSON line and tokenizes one document per call, and
  one builder in the main process that appends each document.

Peak RSS is each process's ``ru_maxrss``: the main process, and the largest worker. CPU s is the
processor time of the main process and its workers together (imports included), the fairer figure when
other work shares the cores.

    .venv/bin/python benchmarks/bench_preprocess.py [--size-mb 200] [--workers 1 2]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHUNKSIZE = 32  # Megatron's imap chunksize in tools/preprocess_data.py


def corpus_file(work_dir: Path, size_mb: int) -> Path:
    """The bundled sample repeated to at least ``size_mb`` MB of JSON lines (written once, atomically)."""
    from zoo.assets import BUNDLED_CORPUS

    path = work_dir / f"wiki-x-{size_mb}mb.jsonl"
    if path.is_file():
        return path
    work_dir.mkdir(parents=True, exist_ok=True)
    sample = gzip.open(BUNDLED_CORPUS, "rb").read()
    sample = sample if sample.endswith(b"\n") else sample + b"\n"
    with tempfile.NamedTemporaryFile(dir=work_dir, delete=False) as out:
        written = 0
        while written < size_mb * 1_000_000:
            out.write(sample)
            written += len(sample)
    os.replace(out.name, path)
    return path


class PeerEncoder:
    """Megatron's Encoder pattern: the Pool initializer builds the tokenizer once per worker process and
    keeps it on the class; ``encode`` turns one raw JSON line into (token ids + EOD, bytes read)."""

    tokenizer = None

    def initializer(self):
        from zoo.data import load_gpt2_tokenizer

        PeerEncoder.tokenizer = load_gpt2_tokenizer()

    def encode(self, line: bytes):
        text = json.loads(line)["text"]
        ids = PeerEncoder.tokenizer.encode(text, verbose=False)
        ids.append(PeerEncoder.tokenizer.eos_token_id)
        return ids, len(line)


def run_peer(corpus: str, prefix: str, workers: int) -> tuple[int, int]:
    """Megatron's preprocess_data.py logic: Pool.imap over lines, one document per encode call, one builder."""
    import multiprocessing

    from zoo.data import IndexedDatasetBuilder

    encoder = PeerEncoder()
    documents = tokens = 0
    with open(corpus, "rb") as lines, multiprocessing.Pool(workers, initializer=encoder.initializer) as pool, \
            IndexedDatasetBuilder(prefix, vocab_size=50257) as builder:
        for ids, _ in pool.imap(encoder.encode, lines, CHUNKSIZE):
            builder.add_document(ids)
            documents += 1
            tokens += len(ids)
    return documents, tokens


def run_zoo(corpus: str, prefix: str, workers: int) -> tuple[int, int]:
    from zoo.data import preprocess

    summary = preprocess([corpus], prefix, workers=workers, progress=False, batch_size=16)
    return summary.documents, summary.tokens


def one_run(harness: str, corpus: str, prefix: str, workers: int) -> dict:
    """Runs one harness in this process and returns its figures (called in a child by :func:`measure`)."""
    import resource
    import time

    start = time.perf_counter()
    documents, tokens = {"zoo": run_zoo, "peer": run_peer}[harness](corpus, prefix, workers)
    seconds = time.perf_counter() - start
    own, workers_usage = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = own.ru_utime + own.ru_stime + workers_usage.ru_utime + workers_usage.ru_stime
    return {"documents": documents, "tokens": tokens, "seconds": seconds, "cpu_seconds": cpu,
            "rss_main_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_worker_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def measure(harness: str, corpus: Path, out_dir: Path, workers: int) -> dict:
    prefix = out_dir / f"{harness}-w{workers}"
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    code = ("import json, sys; sys.path.insert(0, 'benchmarks'); from bench_preprocess import one_run; "
            f"print(json.dumps(one_run({harness!r}, {str(corpus)!r}, {str(prefix)!r}, {workers})))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    with open(f"{prefix}.bin", "rb") as data:
        result["sha256"] = hashlib.file_digest(data, "sha256").hexdigest()
    for ext in ("bin", "idx"):
        Path(f"{prefix}.{ext}").unlink()
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=200, help="size of the generated corpus (MB)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "zoo-bench-preprocess")
    args = parser.parse_args(argv)

    corpus = corpus_file(args.work_dir, args.size_mb)
    print(f"corpus: {corpus} ({corpus.stat().st_size / 1e6:.0f} MB), load average {os.getloadavg()[0]:.2f} "
          f"on {os.cpu_count()} cores")
    rows, results = [], {}
    with tempfile.TemporaryDirectory(dir=args.work_dir) as out_dir:
        for workers in args.workers:
            for harness in ("peer", "zoo"):
                r = measure(harness, corpus, Path(out_dir), workers)
                results[harness, workers] = r
                rows.append([harness, str(workers), f"{r['documents']:,}", f"{r['tokens']:,}", f"{r['seconds']:.1f}",
                             f"{r['tokens'] / r['seconds']:,.0f}", f"{r['cpu_seconds']:.1f}", f"{r['rss_main_mb']:.0f}",
                             f"{r['rss_worker_mb']:.0f}"])
                print("  ".join(rows[-1]), flush=True)
    header = ["harness", "workers", "documents", "tokens", "seconds", "tokens/s", "CPU s", "main RSS MB", "worker RSS MB"]
    print()
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    for workers in args.workers:
        zoo, peer = results["zoo", workers], results["peer", workers]
        same = "identical" if zoo["sha256"] == peer["sha256"] else "DIFFERENT"
        print(f"workers={workers}: zoo/peer tokens/s = {zoo['seconds'] and peer['seconds'] / zoo['seconds']:.2f}x, "
              f".bin {same}")
    if 1 in args.workers and 2 in args.workers:
        for harness in ("zoo", "peer"):
            print(f"{harness}: 2 workers / 1 worker = "
                  f"{results[harness, 1]['seconds'] / results[harness, 2]['seconds']:.2f}x")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
