"""The pipeline GPT and BERT preprocessing share: batches of texts in, one indexed dataset out.

The main process reads batches of documents and writes; ``workers`` processes tokenize. Each worker
runs one fast-tokenizer call per batch with the tokenizer's own threading off, so N workers use N
cores and the throughput grows with N. Results come back in batch order as numpy arrays (cheap to
pass between processes), so the output is byte-identical for every number of workers. At most
``2 * workers + 1`` batches are in flight: memory stays bounded whatever the corpus size, which
``multiprocessing.Pool.imap`` does not guarantee (it consumes its whole input ahead of the workers).

The output is written atomically by :class:`~zoo.data.indexed_dataset.IndexedDatasetBuilder`: a failure
anywhere leaves no ``.bin``/``.idx`` behind, and a scratch directory for ``datasets``' Arrow copies
lives beside the output only while the command runs. A run killed outright (``kill -9``) cannot clean up:
its temporaries are removed by the next run of the same output prefix (:func:`remove_stale_temporaries`).
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from zoo.data.indexed_dataset import IndexedDatasetBuilder, dataset_exists
from zoo.errors import UserError

_END = object()
_RESULT_POLL_S = 1.0  # how often a wait for results checks that the workers are still alive


@dataclass(frozen=True)
class PreprocessSummary:
    prefix: str
    documents: int
    tokens: int
    seconds: float

    @property
    def docs_per_s(self) -> float:
        return self.documents / self.seconds if self.seconds > 0 else float("inf")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")

    def __str__(self) -> str:
        return (
            f"{self.prefix}: {self.documents} documents, {self.tokens} tokens in {self.seconds:.2f} s "
            f"({self.docs_per_s:.1f} docs/s, {self.tokens_per_s:.0f} tokens/s)"
        )


class SkippedDocumentsWarning(UserWarning):
    """Some documents of an input had no string text and have been skipped."""


@contextmanager
def scratch_directory(output_prefix: str | os.PathLike):
    """A temporary directory beside ``output_prefix`` for ``datasets``' Arrow copies, removed afterwards.

    The output's directory is created if missing (one sentence if it cannot be); if the work then fails,
    the directories this created are removed again, so a failed run leaves nothing behind.
    """
    out_dir = Path(os.fspath(output_prefix)).resolve().parent
    created = []
    for directory in (out_dir, *out_dir.parents):
        if directory.exists() or directory.is_symlink():
            break
        created.append(directory)
    try:
        with _output_directory_errors(output_prefix):
            out_dir.mkdir(parents=True, exist_ok=True)
            scratch = tempfile.TemporaryDirectory(dir=out_dir, prefix=scratch_prefix(output_prefix))
        with scratch as cache:
            remove_stale_temporaries(output_prefix, keep=Path(cache).name)
            yield cache
    except BaseException:
        for directory in created:  # deepest first; kept if something else appeared in it
            try:
                directory.rmdir()
            except OSError:
                break
        raise


SCRATCH = ".zoo-preprocess-"
SCRATCH_NAME_CHARS = 100   # of the output's name in a scratch directory's name, which stays under NAME_MAX


def scratch_prefix(output_prefix: str | os.PathLike) -> str:
    """The start of the scratch directory's name: the output's name, this host and this process, which
    tell a later run of the same output whether the writer still runs (:func:`remove_stale_temporaries`)."""
    name = Path(os.fspath(output_prefix)).name[:SCRATCH_NAME_CHARS]
    return f"{SCRATCH}{name}@{socket.gethostname()}@{os.getpid()}@"


def _writer_runs(host: str, pid: int) -> bool:
    """Whether a scratch directory's writer may still run: always for another host (it cannot be checked
    from here) or a pid that runs now (perhaps a reused one: then its temporaries wait for a later run)."""
    if host != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(output_prefix: str | os.PathLike, keep: str) -> list[str]:
    """Remove what killed runs of ``output_prefix`` left beside it, and say so in one line on stderr:
    the builder's ``<prefix>.bin.<hex>.tmp`` and ``.idx`` files, and scratch directories whose writer (named
    in the scratch name) no longer runs on this host. The builder's temporaries are removed only when no
    other writer of this prefix may still run (a scratch directory of a live process, or of another
    host, keeps them all); other prefixes' files are never touched. ``keep`` is this run's own scratch.

    The temporaries are listed before the scratch directories are: a writer that starts meanwhile creates
    its scratch directory before its temporaries, so these are not among those listed or it is seen live.
    Returns the names removed."""
    out_dir = Path(os.fspath(output_prefix)).parent
    name = Path(os.fspath(output_prefix)).name
    builder_temporary = re.compile(re.escape(name) + r"\.(bin|idx)\.[0-9a-f]+\.tmp")
    temporaries = sorted(p for p in out_dir.iterdir() if builder_temporary.fullmatch(p.name))
    scratch_of_prefix = re.compile(re.escape(SCRATCH + name[:SCRATCH_NAME_CHARS]) + r"@([^@]+)@(\d+)@[^@]+")
    stale, live = [], False
    for path in sorted(out_dir.iterdir()):
        match = scratch_of_prefix.fullmatch(path.name)
        if match is None or path.name == keep or not path.is_dir() or path.is_symlink():
            continue
        if _writer_runs(match.group(1), int(match.group(2))):
            live = True
        else:
            stale.append(path)
    removed = []
    for path in ([] if live else temporaries) + stale:
        try:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        except FileNotFoundError:
            continue
        removed.append(path.name)
    if removed:
        print(f"note: removed {len(removed)} temporaries of {os.fspath(output_prefix)} left by a preprocess that did "
              f"not finish: {', '.join(sorted(removed))}", file=sys.stderr, flush=True)
    return removed


def usable_workers(workers: int) -> int:
    """``workers``, capped at the CPUs this process may run on (its affinity, which a container or job
    scheduler sets): more tokenizer processes than CPUs only compete for them, each holding a tokenizer.
    A cap is said in one line on stderr."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # no affinity on this platform
        cpus = os.cpu_count() or 1
    if workers <= cpus:
        return workers
    plural = "s" if cpus > 1 else ""
    print(f"note: --workers {workers} is more than the {cpus} CPU{plural} this process may run on; tokenizing with "
          f"{cpus} worker{plural}.", file=sys.stderr, flush=True)
    return cpus


@contextmanager
def _output_directory_errors(output_prefix):
    """Turns the errors of creating the output's directory into one sentence naming the prefix."""
    try:
        yield
    except (FileExistsError, NotADirectoryError):
        raise UserError(f"output prefix '{os.fspath(output_prefix)}' lies under a file, not a directory; "
                         "choose a prefix inside a directory.") from None
    except PermissionError:
        raise UserError(f"output prefix '{os.fspath(output_prefix)}' is in a directory that cannot be created "
                         "or written (permission denied); choose a prefix in a directory you can write to.") from None


def _worker_loop(encode: Callable, tasks, results) -> None:
    """One tokenizer process: encodes (number, batch) tasks until it receives None, or until the main
    process is gone (killed outright, it sends no None: the worker would otherwise wait forever)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: N workers use N cores
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=_RESULT_POLL_S)
        except queue.Empty:
            if os.getppid() != parent:
                return
            continue
        if task is None:
            return
        number, batch = task
        try:
            results.put((number, encode(batch), None))
        except Exception as err:  # reaches the main process as a RuntimeError naming it
            results.put((number, None, f"{type(err).__name__}: {err}"))
            return


def encoded_in_order(encode: Callable, batches: Iterable, workers: int) -> Iterator:
    """``encode(batch)`` for every batch, computed in ``workers`` processes and yielded in batch order.

    At most ``2 * workers + 1`` batches are read ahead. The processes are forked where the platform
    allows (the tokenizer is inherited, never pickled per batch) and always ended on return or error.
    One worker, or a caller that is itself a daemonic process (which may not start children), encodes
    in this process: the same batches in the same order, without the queues' copies.
    """
    if int(workers) <= 1 or multiprocessing.current_process().daemon:
        yield from (encode(batch) for batch in batches)
        return
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    tasks, results = context.Queue(), context.Queue()
    processes = [context.Process(target=_worker_loop, args=(encode, tasks, results), daemon=True)
                 for _ in range(int(workers))]
    for process in processes:
        process.start()
    batches = iter(batches)
    done, sent, ready = 0, 0, {}
    try:
        while sent < 2 * len(processes) + 1 and (batch := next(batches, _END)) is not _END:
            tasks.put((sent, batch))
            sent += 1
        while done < sent:
            while done not in ready:
                number, encoded, error = _next_result(results, processes)
                if error is not None:
                    raise RuntimeError(f"a tokenizer worker failed on batch {number} ({error}).")
                ready[number] = encoded
            yield ready.pop(done)
            done += 1
            if (batch := next(batches, _END)) is not _END:
                tasks.put((sent, batch))
                sent += 1
    finally:
        for _ in processes:
            tasks.put(None)
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.terminate()
                process.join()
        tasks.cancel_join_thread()
        tasks.close()
        results.close()


def _next_result(results, processes):
    while True:
        try:
            return results.get(timeout=_RESULT_POLL_S)
        except queue.Empty:
            dead = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a tokenizer worker process died (exit code {dead[0]}); "
                                   "check the memory available to --workers processes.") from None


def write_encoded(
    output_prefix: str | os.PathLike,
    vocab_size: int,
    encoded: Iterable,
    write: Callable[[IndexedDatasetBuilder, object], tuple[int, int]],
    no_documents: str,
    progress: bool,
) -> tuple[int, int]:
    """Writes every encoded batch with ``write(builder, batch) -> (documents, tokens)`` into
    ``<output_prefix>.bin/.idx`` (atomically), showing a tqdm bar in tokens/s.

    Returns (documents, tokens). No document at all raises ``UserError(no_documents)`` and writes nothing.
    """
    documents = tokens = 0
    with IndexedDatasetBuilder(output_prefix, vocab_size=vocab_size) as builder, \
            tqdm(desc=f"Tokenizing {Path(os.fspath(output_prefix)).name}", unit="tok", unit_scale=True,
                 disable=not progress) as bar:
        for batch in encoded:
            batch_documents, batch_tokens = write(builder, batch)
            documents += batch_documents
            tokens += batch_tokens
            bar.update(batch_tokens)
            bar.set_postfix(docs=documents, refresh=False)
        if documents == 0:
            raise UserError(no_documents)
    return documents, tokens


def default_cache_dir() -> Path:
    """``$ZOO_CACHE``, else ``~/.cache/zoo``."""
    return Path(os.environ.get("ZOO_CACHE") or Path.home() / ".cache" / "zoo")


def cached_corpus_prefix(corpus: str | os.PathLike, suffix: str, build, cache_dir: str | os.PathLike | None = None,
                         workers: int | None = None, progress: bool = False) -> str:
    """Prefix ``<cache>/<corpus name>_<suffix>`` of a corpus preprocessed once by
    ``build([corpus], prefix, workers=, progress=)``.

    When both files exist it returns at once. An exclusive file lock serializes concurrent callers and
    the builder's atomic rename means a crash leaves nothing half-written. Call it on one rank and
    barrier before the others read it. The caller that builds it prints one line saying what was preprocessed
    and where it is kept (a run's first use of the corpus says so; later runs print nothing).
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    name = Path(corpus).name.split(".")[0]
    prefix = str(cache / f"{name}_{suffix}")
    if dataset_exists(prefix):
        return prefix
    with open(cache / f".{name}_{suffix}.lock", "w") as lock:
        try:
            import fcntl  # local: POSIX only; elsewhere the atomic rename alone protects readers

            fcntl.flock(lock, fcntl.LOCK_EX)
        except ImportError:
            pass
        if not dataset_exists(prefix):
            workers = workers if workers is not None else min(2, os.cpu_count() or 1)
            summary = build([corpus], prefix, workers=workers, progress=progress)
            print(preprocessed_line(corpus, summary), flush=True)
    return prefix


def preprocessed_line(corpus: str | os.PathLike, summary: PreprocessSummary) -> str:
    """The line of a corpus preprocessed into the cache: its documents and tokens, the seconds, and where it is kept."""
    return (f"preprocessed {Path(corpus).name} once: {summary.documents:,} documents, {summary.tokens:,} tokens in "
            f"{summary.seconds:.1f} s, kept in {summary.prefix}.bin/.idx for later runs")
