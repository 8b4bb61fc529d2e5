"""What ``from_pretrained`` hands a user, against transformers' own models from the same directories:

* the model is in eval mode, as transformers returns it: with dropout 0.1 two forwards of one input are equal
  (GPT-2, BERT's pretraining and task heads, Llama);
* training still trains with dropout: pretraining ``--pretrained`` and finetuning, each run twice for one step
  from the same weights and batch, with the directory's dropout 0.1 and with dropout 0, log first losses that
  differ beyond fp32 rounding (1e-5 relative; equal ones would mean the model stayed in eval mode);
* the logits are the real vocabulary (1,000 columns, padded to 1,024 inside) at tp = 1, with and without
  ``gather_output``, and with ``gather_output`` at tp = 2, equal to transformers' (<= 1e-5 relative, fp32, eval
  mode); at tp = 2 without it, this rank's shard of 512 columns.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.checks import rel_err
from tests.helpers.pretraining import run_config
from tests.spawn import spawn

# The random directories hold no tokenizer files; the bundled tokenizer standing in is not what is tested here.
pytestmark = pytest.mark.filterwarnings("ignore::zoo.models.pretrained.BundledTokenizerWarning")

REPO = Path(__file__).resolve().parent.parent
VOCAB, PADDED, SEQ = 1000, 1024, 12
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def directories(tmp_path_factory) -> dict[str, str]:
    """Random transformers models with dropout 0.1 and a 1,000-token vocabulary: GPT-2, Llama, pre-norm BERT."""
    import transformers

    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    models = {
        "gpt2": transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4)),
        "llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.1)),
        "bert": transformers.MegatronBertForPreTraining(transformers.MegatronBertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64)),
    }
    for name, model in models.items():
        model.save_pretrained(root / name)
    return {name: str(root / name) for name in models}


def zoo_class(name: str):
    from zoo.models import BertForPreTraining, GPT2LMHeadModel, LlamaForCausalLM

    return {"gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM, "bert": BertForPreTraining}[name]


def transformers_logits(directory: str, name: str, ids: torch.Tensor) -> torch.Tensor:
    import transformers

    cls = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM,
           "bert": transformers.MegatronBertForPreTraining}[name]
    with torch.no_grad():
        out = cls.from_pretrained(directory).eval()(ids)
    return out.prediction_logits if name == "bert" else out.logits


def logits_of(output) -> torch.Tensor:
    return output.prediction_logits if hasattr(output, "prediction_logits") else output.logits


def _one_step_runs(rank, world_size, corpus, gpt2_dir, bert_dir, root):
    """Pretraining --pretrained and MNLI finetuning, each one step from the same weights and batch, with the
    directory's dropout (0.1) and with dropout 0: their first logged losses."""
    from zoo.cli.finetune import main as finetune
    from zoo.training.pretrain import pretrain

    losses = {}
    for dropout in (None, 0.0):
        overrides = {} if dropout is None else dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        save = f"{root}/pretrain-{dropout}"
        pretrain(run_config(corpus, save, 1, 2, 2, 1, pretrained=gpt2_dir, model_overrides=overrides))
        losses["pretrain", dropout] = first_loss(save)
        save = f"{root}/finetune-{dropout}"
        finetune("mnli", ["--deepspeed_config", str(REPO / "ds_configs" / "finetune_cpu.json"), "--pretrained",
                          bert_dir, "--data-dir", str(REPO / "tests" / "fixtures" / "finetune" / "mnli"),
                          "--save", save, "--epochs", "0.5", "--batch-size", "2", "--max-seq-length", "64",
                          "--log-interval", "1", "--tensor-parallel-size", "1",
                          *(["--dropout", "0"] if dropout == 0.0 else [])])
        losses["finetune", dropout] = first_loss(save)
    return losses


def first_loss(run_dir: str) -> float:
    from zoo.training.metrics import read_metrics

    return next(e["loss"] for e in read_metrics(run_dir) if "loss" in e and "split" not in e)


def test_from_pretrained_returns_eval_mode_and_training_still_drops_out(directories, corpus_prefix, tmp_path):
    import transformers

    from zoo.models.bert.heads import BertForSequenceClassification

    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    loaded = {name: zoo_class(name).from_pretrained(directory) for name, directory in directories.items()}
    loaded["bert-classifier"] = BertForSequenceClassification.from_pretrained(directories["bert"], num_labels=3)
    for name, model in loaded.items():
        assert not [n for n, m in model.named_modules() if m.training], f"{name}: modules left in training mode"
        with torch.no_grad():
            first, second = logits_of(model(ids)), logits_of(model(ids))
        assert torch.equal(first, second), f"{name}: two forwards differ by {(first - second).abs().max():.3g}"

    # training: directories with the vocabularies of the corpus (GPT-2 BPE) and of the MNLI fixture (WordPiece)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=64, n_embd=32, n_layer=2, n_head=4)
                                 ).save_pretrained(tmp_path / "gpt2")
    transformers.MegatronBertForPreTraining(transformers.MegatronBertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=128)
    ).save_pretrained(tmp_path / "bert")
    (losses,) = spawn(_one_step_runs, 1, corpus_prefix, str(tmp_path / "gpt2"), str(tmp_path / "bert"), str(tmp_path))
    for run in ("pretrain", "finetune"):
        with_dropout, without = losses[run, None], losses[run, 0.0]
        # the same ops on the same weights and batch unless dropout acts: beyond fp32 rounding (1e-5 relative)
        assert abs(with_dropout - without) > 1e-5 * without, (run, losses)


def _tp2_logits(rank, world_size, directories, ids):
    from zoo.parallel import ParallelState

    ps = ParallelState.initialize(2)
    results = {}
    for name, directory in directories.items():
        model = zoo_class(name).from_pretrained(directory, parallel=ps).eval()   # .eval(): tested above
        with torch.no_grad():
            results[name] = (logits_of(model(ids)), logits_of(model(ids, gather_output=True)))
    return results


def test_logits_are_the_real_vocabulary_at_tp1_and_gathered_at_tp2(directories):
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    ranks = spawn(_tp2_logits, 2, directories, ids)
    for name, directory in directories.items():
        expected = transformers_logits(directory, name, ids)                     # (b, s, V)
        model = zoo_class(name).from_pretrained(directory).eval()                # tp = 1
        for gather in (False, True):
            with torch.no_grad():
                logits = logits_of(model(ids, gather_output=gather))
            assert logits.shape == (2, SEQ, VOCAB), (name, gather, tuple(logits.shape))
            assert rel_err(logits, expected) <= REL_TOL, (name, gather)
        for rank, results in enumerate(ranks):                                   # tp = 2
            shard, gathered = results[name]
            assert shard.shape == (2, SEQ, PADDED // 2), (name, rank, tuple(shard.shape))
            real = shard[..., :VOCAB - rank * PADDED // 2]                       # rank 1 holds the 24 padding columns
            assert rel_err(real, expected[..., rank * PADDED // 2:][..., :real.shape[-1]]) <= REL_TOL, (name, rank)
            assert gathered.shape == (2, SEQ, VOCAB), (name, rank, tuple(gathered.shape))
            assert rel_err(gathered, expected) <= REL_TOL, (name, rank)
