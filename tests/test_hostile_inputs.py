"""Hostile inputs and faults end in one sentence (exit 2) or go on, never in a traceback.

* a rank's standard streams: closed at start (``>&-``) or pointed at ``/dev/full``, a guarded process
  goes on, its prints and log records land in the run directory's output-rank<R>.log while its working
  stderr still reaches the user, and it exits 0;
* the zoo block's ``model_overrides``: each value gets its family's checks (type, bounds, probability,
  positive epsilon), as a config.json's values do, before anything is built or written;
* ``--tensorboard-dir`` naming a file, a path under a file or a directory nothing can be written into:
  one sentence, exit 2, nothing written and the file untouched;
* a checkpoint file whose pickle calls ``os.system`` (torch's zip format or the plain-pickle one): refused
  as code, not as a truncated file, with no advice to load it with ``weights_only=False``; nothing ran;
* a GPT-2 directory as ``--pretrained`` of a Llama preset, or the reverse: one sentence saying the
  families differ, exit 2;
* finetuning's input errors (flags, the model directory, the task data) are printed once per job, by the
  writer rank, as pretraining's are: every other rank exits 2 in silence;
* a ``.bin`` longer than its ``.idx`` describes (another corpus's data next to this index) is refused, as a
  shorter one is;
* zoo's launcher: a ``--master_port`` of 0 (the ranks would never meet) or above 65535, and a hostfile
  with a line that is no ``HOST slots=N``: one sentence, exit 2, nothing started;
* a sweep whose grid key is no flag of its finetune script: refused by ``--dry-run`` (and so before a real
  sweep's first run), naming the key and the closest flag;
* fp16 asked for where the accelerator has no native fp16: one sentence naming ``--bf16``, exit 2; a first
  GPU run says on one line that DeepSpeed compiles FusedAdam, before it does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checks import one_error_line

REPO = Path(__file__).resolve().parent.parent
DEMO_DS_CONFIG = json.loads((REPO / "ds_configs" / "cpu_demo.json").read_text())

GUARDED_AT_START = """
import logging, sys
from tqdm import tqdm
early = logging.getLogger("early_library")
early.addHandler(logging.StreamHandler(sys.stdout))     # a library's handler, made before the guard
early.propagate = False
from zoo.operations.output_guard import guard_output, keep_output_in
guard_output()
keep_output_in(sys.argv[1])
print("a log line", flush=True)
early.warning("a library's warning")
for _ in tqdm(range(3)):
    pass
print("an error line", file=sys.stderr, flush=True)
open(sys.argv[1] + "/survived", "w").close()
"""


@pytest.mark.parametrize("stdout", ["closed", "/dev/full"])
def test_a_rank_survives_a_closed_or_full_stdout(tmp_path, stdout):
    env = dict(os.environ, RANK="1")
    if stdout == "closed":
        cmd = f'exec "{sys.executable}" -c "$0" "$1" >&-'
    else:
        cmd = f'exec "{sys.executable}" -c "$0" "$1" >/dev/full'
    proc = subprocess.run(["bash", "-c", cmd, GUARDED_AT_START, str(tmp_path)], cwd=REPO, env=env,
                          stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "survived").exists()
    log = (tmp_path / "output-rank1.log").read_text()
    assert "Traceback" not in log + proc.stderr, log + proc.stderr
    reason = "stdout was closed at start" if stdout == "closed" else "writing to stdout/stderr failed (ENOSPC"
    assert f"rank 1: {reason}" in log, log
    assert "a log line" in log and "a library's warning" in log + proc.stderr, log + proc.stderr
    assert "an error line" in proc.stderr, proc.stderr      # stderr still worked: it still reaches the user


OVERRIDE_CASES = {
    "llama-negative-eps": ("llama-tiny", {"rms_norm_eps": -1e-5},
                           "model_overrides field rms_norm_eps is -1e-05, not a positive number"),
    "llama-eps-a-string": ("llama-tiny", {"rms_norm_eps": "small"},
                           'model_overrides field rms_norm_eps is "small" (a string), not a number'),
    "gpt2-layers-a-string": ("gpt2-tiny", {"n_layer": "small"},
                             'model_overrides field n_layer is "small" (a string), not an integer'),
    "gpt2-dropout-above-1": ("gpt2-tiny", {"resid_pdrop": 1.5},
                             "model_overrides field resid_pdrop is 1.5, not a probability in [0, 1]"),
    "bert-pre-norm-a-string": ("bert-tiny", {"pre_norm": "yes"},
                               'model_overrides field pre_norm is "yes" (a string), not true or false'),
}


@pytest.mark.parametrize("case", sorted(OVERRIDE_CASES))
def test_model_overrides_get_the_family_checks(case, tmp_path, capsys):
    from zoo.cli.pretrain import main

    preset, overrides, needle = OVERRIDE_CASES[case]
    path = tmp_path / "ds.json"
    config = dict(DEMO_DS_CONFIG, zoo={**DEMO_DS_CONFIG["zoo"], "model": preset, "model_overrides": overrides,
                                       "tensor_parallel_size": 1, "sample_prompts": [],
                                       "data_path": str(tmp_path / "no-corpus")})
    path.write_text(json.dumps(config))
    with pytest.raises(SystemExit) as exit_info:
        main(["--deepspeed_config", str(path), "--save", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    assert needle in one_error_line(capsys, from_zoo=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.json"]


def _refused_pretraining(tmp_path, capsys, zoo_block: dict, flags: list[str]) -> str:
    """launch/pretrain.py over the demo config with ``zoo_block`` changes and ``flags``: exit 2, the one
    error line returned, and nothing written next to the config."""
    from zoo.cli.pretrain import main

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(dict(DEMO_DS_CONFIG, zoo={**DEMO_DS_CONFIG["zoo"], **zoo_block})))
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(SystemExit) as exit_info:
        main(["--deepspeed_config", str(path), "--save", str(tmp_path / "run"), *flags])
    assert exit_info.value.code == 2
    line = one_error_line(capsys, from_zoo=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    return line


@pytest.mark.parametrize("target", ["a-file", "under-a-file", "proc"])
def test_an_unusable_tensorboard_dir_is_one_sentence(tmp_path, capsys, target):
    existing = tmp_path / "notes.txt"
    existing.write_text("the user's file")
    directory = {"a-file": existing, "under-a-file": existing / "tb", "proc": Path("/proc/zoo-tensorboard")}[target]
    line = _refused_pretraining(tmp_path, capsys, {"tensorboard_dir": str(directory), "tensor_parallel_size": 1,
                                 "data_path": str(tmp_path / "no-corpus")}, [])
    assert f"--tensorboard-dir {directory}" in line, line
    assert existing.read_text() == "the user's file"


class _RunsCode:
    """Unpickling this calls os.system: the marker file appears if it ever runs."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("layout", ["torch-zip", "plain-pickle"])
def test_a_code_running_checkpoint_is_named_for_what_it_is(tmp_path, layout):
    import pickle

    import torch

    from zoo.checkpoint.safe_load import check_tag_files
    from zoo.errors import UserError

    tag, marker = tmp_path / "global_step1", tmp_path / "code-ran"
    tag.mkdir()
    planted = tag / "mp_rank_00_model_states.pt"
    content = {"module": {"w": torch.zeros(2)}, "payload": _RunsCode(marker)}
    if layout == "torch-zip":
        torch.save(content, planted)
    else:
        planted.write_bytes(pickle.dumps(content))
    with pytest.raises(UserError) as err:
        check_tag_files(tag)
    message = str(err.value)
    assert f"{planted} holds the pickled global posix.system, code that loading the file would run" in message
    assert "truncated" not in message and "weights_only" not in message and "\n" not in message, message
    assert not marker.exists()


@pytest.fixture(scope="module")
def family_directories(tmp_path_factory) -> dict[str, Path]:
    """A one-layer GPT-2 and a one-layer Llama, each saved in transformers' layout."""
    from zoo.models import GPT2LMHeadModel
    from zoo.models.families import model_config
    from zoo.models.llama import LlamaForCausalLM

    root = tmp_path_factory.mktemp("families")
    GPT2LMHeadModel(model_config("gpt2-tiny", n_layer=1)).save_pretrained(root / "gpt2")
    LlamaForCausalLM(model_config("llama-tiny", num_hidden_layers=1)).save_pretrained(root / "llama")
    return {"gpt2": root / "gpt2", "llama": root / "llama"}


@pytest.mark.parametrize(("directory", "preset"), [("gpt2", "llama-tiny"), ("llama", "gpt2-tiny")])
def test_pretrained_of_another_family_says_the_families_differ(tmp_path, capsys, family_directories,
                                                                directory, preset):
    shown_family = {"gpt2": "GPT-2", "llama": "Llama"}
    line = _refused_pretraining(tmp_path, capsys, {"model": preset, "tensor_parallel_size": 1, "sample_prompts": [],
                                                   "model_overrides": {}}, ["--pretrained",
                                                                            str(family_directories[directory])])
    other = "Llama" if directory == "gpt2" else "GPT-2"
    assert (f"{family_directories[directory]} holds a {shown_family[directory]} model" in line
            and f"the run's preset is {other}, and the families differ" in line), line


@pytest.mark.parametrize("wrong", ["no-pretrained-directory", "no-training-split"])
@pytest.mark.parametrize("rank", ["0", "1"])
def test_finetuning_input_errors_are_printed_once_per_job(tmp_path, capsys, monkeypatch,
                                                          wrong, rank):
    from zoo.cli.finetune import main
    from zoo.models import BertForPreTraining
    from zoo.models.families import model_config

    bert = tmp_path / "bert"
    BertForPreTraining(model_config("bert-tiny", num_hidden_layers=1)).save_pretrained(bert)
    data = tmp_path / "mnli"
    data.mkdir()
    pretrained = tmp_path / "absent" if wrong == "no-pretrained-directory" else bert
    monkeypatch.setenv("RANK", rank)        # as the launcher sets it on each rank, before any process group
    with pytest.raises(SystemExit) as exit_info:
        main("mnli", ["--deepspeed_config", str(REPO / "ds_configs" / "finetune_cpu.json"), "--pretrained",
                      str(pretrained), "--data-dir", str(data), "--save", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    if rank == "0":
        assert one_error_line(capsys, from_zoo=True).startswith("error: ")
    else:
        assert "error" not in capsys.readouterr().err


def test_a_bin_longer_than_its_index_describes_is_refused(tmp_path):
    import shutil

    from zoo.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    from zoo.errors import UserError

    for prefix, documents in (("small", [[1, 2, 3]]), ("large", [[1, 2, 3], [4, 5, 6, 7]])):
        with IndexedDatasetBuilder(tmp_path / prefix, vocab_size=100) as builder:
            for document in documents:
                builder.add_document(document)
    shutil.copy(tmp_path / "large.bin", tmp_path / "small.bin")      # another corpus's data, this index
    with pytest.raises(UserError) as err:
        IndexedDataset(tmp_path / "small")
    assert (f"data file '{tmp_path / 'small.bin'}' holds 14 bytes but its index '{tmp_path / 'small.idx'}' "
            "describes 6 (1 sequence)") in str(err.value)
    assert len(IndexedDataset(tmp_path / "large")) == 2


LAUNCHER_CASES = {
    "port-0": (["--master_port", "0"], None, "--master_port 0 is not a TCP port the ranks can meet on"),
    "port-70000": (["--master_port=70000"], None, "--master_port 70000 is not a TCP port the ranks can meet on"),
    "garbage-line": ([], "worker-1 slots=2\n%%garbage%%\n", "line 2 of hostfile {hostfile}, '%%garbage%%', "
                                                             "names no slots"),
    "slots-two": ([], "# the nodes\nworker-1 slots=two\n", "line 2 of hostfile {hostfile} gives worker-1 "
                                                             "slots=two, not a count of ranks"),
}


@pytest.mark.parametrize("case", sorted(LAUNCHER_CASES))
def test_the_launcher_refuses_a_bad_port_or_hostfile_in_one_sentence(tmp_path, capsys, case):
    from zoo.cli.run import main

    flags, hostfile_text, needle = LAUNCHER_CASES[case]
    hostfile = tmp_path / "hostfile"
    if hostfile_text is not None:
        hostfile.write_text(hostfile_text)
    marker, script = tmp_path / "started", tmp_path / "script.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["--hostfile", str(hostfile), *flags, "--num_gpus", "1", str(script)])
    assert exit_info.value.code == 2
    assert needle.format(hostfile=hostfile) in one_error_line(capsys, from_zoo=True)
    assert not marker.exists()


def test_a_sweep_dry_run_refuses_a_grid_key_that_is_no_flag(tmp_path, capsys):
    from zoo.cli.sweep import main

    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("""program: finetune/qqp.py
method: grid
metric: {name: best/dev/accuracy, goal: maximize}
parameters:
  bach-size: {values: [16, 32]}
  seed: {value: 1}
""")
    with pytest.raises(SystemExit) as exit_info:
        main([str(sweep), "--dry-run", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    line = one_error_line(capsys, from_zoo=True)
    assert (f"sweep file {sweep} has parameter 'bach-size', which is no flag of finetune/qqp.py" in line
            and "the closest is 'batch-size'" in line), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.yaml"]


def test_fp16_without_native_fp16_is_one_sentence_naming_bf16(tmp_path, capsys, monkeypatch):
    from deepspeed.accelerator import get_accelerator

    from tests.helpers.random_corpus import make_corpus

    # CPUs differ (DESIGN.md): an AMD EPYC has no native fp16, a Xeon with AMX has; the test makes the
    # accelerator answer as the former does, so it holds on both kinds of machine.
    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: False)
    corpus = make_corpus(tmp_path / "random")
    line = _refused_pretraining(tmp_path, capsys, {"tensor_parallel_size": 1, "sample_prompts": [],
                                                   "data_path": corpus, "train_iters": 1},
                                ["--fp16"])
    assert "has no native fp16" in line and "pass --bf16 instead" in line, line


def test_a_first_gpu_run_says_it_compiles_fused_adam(tmp_path, capsys, monkeypatch):
    import deepspeed.accelerator
    import deepspeed.git_version_info

    from zoo.training.engine import announce_fused_adam_build

    class Gpu:   # what DeepSpeed's CUDA accelerator answers on a GPU node
        def device_name(self, index=None):
            return "cuda"

    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: Gpu())
    monkeypatch.setattr(deepspeed.git_version_info, "installed_ops", {"fused_adam": False})
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    adamw = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    announce_fused_adam_build(adamw, is_writer=False)
    assert capsys.readouterr().out == ""
    announce_fused_adam_build(adamw, is_writer=True)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("DeepSpeed is compiling its FusedAdam kernel"), lines
    built = tmp_path / "extensions" / "fused_adam"
    (built / "fused_adam.so").touch()                       # the next run loads the cached build
    announce_fused_adam_build(adamw, is_writer=True)
    announce_fused_adam_build({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}, is_writer=True)
    (built / "fused_adam.so").unlink()
    announce_fused_adam_build({"optimizer": {"type": "SGD"}}, is_writer=True)
    assert capsys.readouterr().out == ""


def test_finetuning_in_fp16_without_native_fp16_is_one_sentence_naming_bf16(tmp_path, capsys, monkeypatch):
    from deepspeed.accelerator import get_accelerator

    from zoo.cli.finetune import main
    from zoo.models import BertForPreTraining
    from zoo.models.families import model_config

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: False)   # as an AMD EPYC answers
    bert = tmp_path / "bert"
    BertForPreTraining(model_config("bert-tiny", num_hidden_layers=1)).save_pretrained(bert)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({**json.loads((REPO / "ds_configs" / "finetune_cpu.json").read_text()),
                                  "fp16": {"enabled": True}}))
    with pytest.raises(SystemExit) as exit_info:
        main("mnli", ["--deepspeed_config", str(config), "--pretrained", str(bert), "--data-dir",
                      str(REPO / "tests" / "fixtures" / "finetune" / "mnli"), "--save", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    line = one_error_line(capsys, from_zoo=True)
    assert "has no native fp16" in line and f'enable "bf16" in place of "fp16" in {config}' in line, line
    assert not (tmp_path / "run").exists()
