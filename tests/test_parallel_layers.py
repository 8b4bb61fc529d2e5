"""ColumnParallelLinear, RowParallelLinear and VocabParallelEmbedding against single-process references
(F.linear / F.embedding) on the same master weights, at tp = 1, 2 and 4, in float32 and float64.

Tolerances for outputs, input grads and merged weight/bias grads:
- float32: max|zoo - ref| <= 1e-6 x max(|A| |B|), the same computation on the absolute values of its
  operands. Every checked quantity is a sum of products, and the rounding of a sum (in any order, over
  any split across ranks) is bounded by its terms' magnitudes, not by its own value, which cancellation
  can make small (a hidden-state grad summed over 300 vocabulary rows reached 5.7e-7 of its own size);
- float64: max|zoo - ref| / max|ref| <= 1e-9.
TP-invariant init and the partitioning helpers are exact (torch.equal).

The master weights are drawn in the test and each rank's shard is cut by an independent implementation
(``_shard``), so a wrong partition rule in zoo shows up here. Gradients are merged with
``zoo.parallel.utils.merge_shards``, whose layout is itself checked against hand-written values below.
tp = 1 runs in the pytest process (``parallel=None``); tp = 2 and 4 run in one world-4 spawn.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.checks import FP64_TOL, assert_named_checks, rel_err
from tests.spawn import spawn

REL_TOL = 1e-6
WORLD = 4
LEAD = (3, 5)                       # leading (batch, seq) dims of every input
IN, OUT = 8, 24                     # OUT divisible by stride 3 x tp 4
VOCAB, PAD_MULTIPLE, DIM = 300, 16, 8
# Padded to 320 at tp 2 and 4 (80 rows per rank at tp 4: rank 3 holds rows 240..319, 300..319 padding),
# and to 304 at tp 1.
IDS = torch.tensor([[0, 79, 80, 159, 160, 239], [240, 299, 5, 150, 298, 1], [77, 81, 0, 299, 200, 120]])


def _shard(master: torch.Tensor, dim: int, rank: int, tp: int, stride: int = 1) -> torch.Tensor:
    """The contract's partition, written independently of zoo: split ``dim`` into ``stride`` blocks and
    give every rank the rank-th tp-th of each block."""
    return torch.cat([block.chunk(tp, dim)[rank] for block in master.chunk(stride, dim)], dim)


def _randn(gen: torch.Generator, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    """The same values in every dtype: drawn in float32, then cast."""
    return torch.randn(*shape, generator=gen).to(dtype)


def _linear_reference(W, b, X, G) -> tuple[torch.Tensor, ...]:
    """y = X W^T + b, and the grads of X, W, b for upstream G. Called on |W|, |b|, |X|, |G| it gives the
    magnitudes that bound each quantity's rounding."""
    W, X = W.clone().requires_grad_(), X.clone().requires_grad_()
    b = None if b is None else b.clone().requires_grad_()
    y = F.linear(X, W, b)
    (y * G).sum().backward()
    return y.detach(), X.grad, W.grad, None if b is None else b.grad


def _embedding_reference(E_pad, G) -> tuple[torch.Tensor, torch.Tensor]:
    """y = E[IDS] (real rows only), and the grad of the padded table for upstream G."""
    E_pad = E_pad.clone().requires_grad_()
    y = F.embedding(IDS, E_pad[:VOCAB])
    (y * G).sum().backward()
    return y.detach(), E_pad.grad


def _error_measure(dtype: torch.dtype):
    """error(actual, expected, magnitude): see the module docstring."""
    if dtype == torch.float64:
        return lambda actual, expected, magnitude: rel_err(actual, expected)
    return lambda actual, expected, magnitude: ((actual - expected).abs().max() / magnitude.abs().max()).item()


def _all_shards(ps, tensor):
    import torch.distributed as dist

    if ps is None:
        return [tensor]
    pieces = [torch.empty_like(tensor) for _ in range(ps.tp_size)]
    dist.all_gather(pieces, tensor.contiguous(), group=ps.tp_group)
    return pieces


def _layer_checks(ps, dtype: torch.dtype = torch.float32) -> dict:
    """Every layer check at this rank's tp degree in ``dtype``; ``ps`` None means tp = 1 in this process.
    Returns {name: error} for tolerance checks and {name: bool} for exact ones."""
    from zoo.parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from zoo.parallel.utils import merge_shards

    tp = 1 if ps is None else ps.tp_size
    r = 0 if ps is None else ps.tp_rank
    error = _error_measure(dtype)

    def all_shards(tensor):
        return _all_shards(ps, tensor)

    out: dict = {}
    gen = torch.Generator().manual_seed(1)

    # ------------------------------------------------------------ ColumnParallelLinear
    for gather, stride in ((False, 1), (True, 1), (False, 3)):
        tag = f"column[gather={gather},stride={stride}]"
        W, b, X, G = (_randn(gen, dtype, OUT, IN), _randn(gen, dtype, OUT), _randn(gen, dtype, *LEAD, IN),
                      _randn(gen, dtype, *LEAD, OUT))
        y_ref, x_grad, w_grad, b_grad = _linear_reference(W, b, X, G)
        y_mag, x_mag, w_mag, b_mag = _linear_reference(W.abs(), b.abs(), X.abs(), G.abs())

        layer = ColumnParallelLinear(IN, OUT, bias=True, gather_output=gather, parallel=ps, stride=stride).to(dtype)
        with torch.no_grad():
            layer.weight.copy_(_shard(W, 0, r, tp, stride))
            layer.bias.copy_(_shard(b, 0, r, tp, stride))
        x = X.clone().requires_grad_()
        y = layer(x)
        if gather:
            expected_y, upstream = y_ref, G
        else:
            expected_y, upstream = _shard(y_ref, -1, r, tp, stride), _shard(G, -1, r, tp, stride)
        out[f"{tag} output shape"] = tuple(y.shape) == tuple(expected_y.shape)
        out[f"{tag} output"] = error(y, expected_y, y_mag)
        (y * upstream).sum().backward()
        out[f"{tag} input grad"] = error(x.grad, x_grad, x_mag)   # f all-reduces it: full on every rank
        out[f"{tag} weight grad"] = error(merge_shards(all_shards(layer.weight.grad), 0, stride), w_grad, w_mag)
        out[f"{tag} bias grad"] = error(merge_shards(all_shards(layer.bias.grad), 0, stride), b_grad, b_mag)
        out[f"{tag} weight tags"] = (layer.weight.tensor_model_parallel is True and layer.weight.partition_dim == 0
                                     and layer.weight.partition_stride == stride)
        out[f"{tag} bias tags"] = (layer.bias.tensor_model_parallel is True and layer.bias.partition_dim == 0
                                   and layer.bias.partition_stride == stride)

    # ------------------------------------------------------------ RowParallelLinear
    for input_is_parallel in (True, False):
        tag = f"row[input_is_parallel={input_is_parallel}]"
        W, X, G = _randn(gen, dtype, OUT, IN), _randn(gen, dtype, *LEAD, IN), _randn(gen, dtype, *LEAD, OUT)
        b = _randn(gen, dtype, OUT) + 3.0                  # far from 0: a bias added tp times would show
        y_ref, x_grad, w_grad, b_grad = _linear_reference(W, b, X, G)
        y_mag, x_mag, w_mag, b_mag = _linear_reference(W.abs(), b.abs(), X.abs(), G.abs())

        layer = RowParallelLinear(IN, OUT, bias=True, input_is_parallel=input_is_parallel, parallel=ps).to(dtype)
        with torch.no_grad():
            layer.weight.copy_(_shard(W, 1, r, tp))
            layer.bias.copy_(b)
        x = (_shard(X, -1, r, tp) if input_is_parallel else X.clone()).requires_grad_()
        y = layer(x)
        out[f"{tag} output"] = error(y, y_ref, y_mag)
        (y * G).sum().backward()
        expected_x_grad = _shard(x_grad, -1, r, tp) if input_is_parallel else x_grad
        out[f"{tag} input grad"] = error(x.grad, expected_x_grad, x_mag)
        out[f"{tag} weight grad"] = error(merge_shards(all_shards(layer.weight.grad), 1), w_grad, w_mag)
        out[f"{tag} bias grad"] = error(layer.bias.grad, b_grad, b_mag)   # replicated: full on every rank
        out[f"{tag} weight tags"] = (layer.weight.tensor_model_parallel is True and layer.weight.partition_dim == 1)
        out[f"{tag} bias untagged"] = not (hasattr(layer.bias, "tensor_model_parallel")
                                           or hasattr(layer.bias, "partition_dim"))

    # ------------------------------------------------------------ VocabParallelEmbedding
    E, G = _randn(gen, dtype, VOCAB, DIM), _randn(gen, dtype, *IDS.shape, DIM)
    layer = VocabParallelEmbedding(VOCAB, DIM, parallel=ps, pad_multiple=PAD_MULTIPLE).to(dtype)
    padded = layer.padded_vocab_size
    out["embedding padded size"] = padded == (304 if tp == 1 else 320)
    per_rank = padded // tp
    out["embedding row range"] = (layer.vocab_start, layer.vocab_end) == (r * per_rank, (r + 1) * per_rank)
    E_pad = torch.cat([E, torch.zeros(padded - VOCAB, DIM, dtype=dtype)])
    y_ref, e_grad = _embedding_reference(E_pad, G)
    y_mag, e_mag = _embedding_reference(E_pad.abs(), G.abs())
    with torch.no_grad():
        layer.weight.copy_(_shard(E_pad, 0, r, tp))
    y = layer(IDS)
    out["embedding output"] = error(y, y_ref, y_mag)
    (y * G).sum().backward()
    merged_grad = merge_shards(all_shards(layer.weight.grad), 0)
    out["embedding weight grad"] = error(merged_grad, e_grad, e_mag)
    out["embedding padded rows get zero grad"] = bool((merged_grad[VOCAB:] == 0).all())
    out["embedding weight tags"] = (layer.weight.tensor_model_parallel is True and layer.weight.partition_dim == 0)

    # Tied output embedding: logits over the full unpadded vocab with gather_output, grads of H and E.
    H, GL = _randn(gen, dtype, *LEAD, DIM), _randn(gen, dtype, *LEAD, VOCAB)
    logits_ref, h_grad, e_grad, _ = _linear_reference(E, None, H, GL)
    logits_mag, h_mag, e_mag, _ = _linear_reference(E.abs(), None, H.abs(), GL.abs())
    layer.weight.grad = None
    h = H.clone().requires_grad_()
    logits = layer.lm_logits(h, gather_output=True)
    out["lm_logits shape"] = tuple(logits.shape) == (*LEAD, VOCAB)
    out["lm_logits output"] = error(logits, logits_ref, logits_mag)
    (logits * GL).sum().backward()
    out["lm_logits hidden grad"] = error(h.grad, h_grad, h_mag)
    merged_grad = merge_shards(all_shards(layer.weight.grad), 0)
    out["lm_logits weight grad"] = error(merged_grad[:VOCAB], e_grad, e_mag)
    out["lm_logits padded rows get zero grad"] = bool((merged_grad[VOCAB:] == 0).all())
    return out


def _init_checks(ps) -> dict:
    """TP-invariant initialisation, exact: the merged shards equal the tp = 1 weights."""
    from zoo.parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from zoo.parallel.utils import merge_shards

    out: dict = {}
    builders = {
        "column stride 1": (lambda p: ColumnParallelLinear(IN, OUT, parallel=p), 0, 1),
        "column stride 3": (lambda p: ColumnParallelLinear(IN, OUT, parallel=p, stride=3), 0, 3),
        "row": (lambda p: RowParallelLinear(IN, OUT, parallel=p), 1, 1),
        "embedding": (lambda p: VocabParallelEmbedding(VOCAB, DIM, parallel=p, pad_multiple=PAD_MULTIPLE), 0, 1),
    }
    for name, (build, dim, stride) in builders.items():
        torch.manual_seed(1234)
        reference = build(None).weight.detach()
        torch.manual_seed(1234)
        merged = merge_shards(_all_shards(ps, build(ps).weight.detach()), dim, stride)
        if name == "embedding":     # tp 1 pads to 304 rows, tp 2 and 4 to 320: compare the real rows
            out[f"init {name} padded rows are zero"] = bool((merged[VOCAB:] == 0).all())
            merged, reference = merged[:VOCAB], reference[:VOCAB]
        out[f"init {name} equals tp=1"] = torch.equal(merged, reference)
        out[f"init {name} is N(0, 0.02)"] = abs(reference.std().item() - 0.02) < 0.003
    return out


def _all_checks(ps) -> dict:
    """{dtype name: {check: error or bool}}; the exact init checks sit with float32."""
    return {"float32": {**_layer_checks(ps, torch.float32), **_init_checks(ps)},
            "float64": _layer_checks(ps, torch.float64)}


def _layers_worker(rank, world_size):
    from zoo.parallel import ParallelState

    return {tp: _all_checks(ParallelState.initialize(tp)) for tp in (2, 4)}


@pytest.fixture(scope="module")
def layer_results():
    torch.manual_seed(0)
    by_tp = {1: [_all_checks(None)]}
    per_rank = spawn(_layers_worker, WORLD)
    for tp in (2, 4):
        by_tp[tp] = [results[tp] for results in per_rank]
    return {dtype: {tp: [results[dtype] for results in ranks] for tp, ranks in by_tp.items()}
            for dtype in ("float32", "float64")}


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("prefix", ["column[gather=False,stride=1]", "column[gather=True,stride=1]",
                                    "column[gather=False,stride=3]", "row[input_is_parallel=True]",
                                    "row[input_is_parallel=False]", "embedding", "lm_logits", "init"])
def test_layer_matches_reference(layer_results, tp, prefix):
    assert_named_checks(layer_results["float32"], tp, prefix, REL_TOL)
    if prefix != "init":
        assert_named_checks(layer_results["float64"], tp, prefix, FP64_TOL)


# ---------------------------------------------------------------- partitioning helpers (exact)
def test_pad_vocab_size():
    from zoo.parallel import pad_vocab_size

    assert pad_vocab_size(50257, 8) == 51200
    assert pad_vocab_size(50257, 1) == 50304
    assert pad_vocab_size(50257, 2) == 50432
    assert pad_vocab_size(50304, 1) == 50304           # already a multiple: unchanged
    assert pad_vocab_size(300, 4, multiple=16) == 320
    with pytest.raises(ValueError, match="multiple 0"):
        pad_vocab_size(300, 2, multiple=0)


def test_shard_tensor_layout_with_stride_3():
    from zoo.parallel import shard_tensor

    master = torch.arange(12)                           # blocks [0..3] [4..7] [8..11], e.g. Q | K | V
    assert shard_tensor(master, 0, 0, 2, stride=3).tolist() == [0, 1, 4, 5, 8, 9]
    assert shard_tensor(master, 0, 1, 2, stride=3).tolist() == [2, 3, 6, 7, 10, 11]
    assert shard_tensor(master, 0, 1, 2).tolist() == [6, 7, 8, 9, 10, 11]


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("stride", [1, 3])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_merge_round_trip(tp, stride, dim):
    from zoo.parallel import merge_shards, shard_tensor

    master = torch.arange(24 * 36, dtype=torch.float32).view(24, 36)
    shards = [shard_tensor(master, dim, rank, tp, stride) for rank in range(tp)]
    for rank, shard in enumerate(shards):
        assert torch.equal(shard, _shard(master, dim, rank, tp, stride)), f"shard of rank {rank}"
    assert torch.equal(merge_shards(shards, dim, stride), master)


def test_indivisible_partition_is_refused():
    from zoo.parallel import ColumnParallelLinear, ParallelState, RowParallelLinear, divide

    with pytest.raises(ValueError, match=r"hidden size 10 is not divisible by 4"):
        divide(10, 4, "hidden size")
    # A tp = 3 grid built by hand: the shape check comes before any process group is touched.
    fake = ParallelState(tp_size=3, tp_rank=0, tp_group=None, dp_size=1, dp_rank=0, dp_group=None,
                         world_size=3, rank=0)
    with pytest.raises(ValueError, match=r"output features 8 is not divisible by 3"):
        ColumnParallelLinear(4, 8, parallel=fake)
    with pytest.raises(ValueError, match=r"input features 8 is not divisible by 3"):
        RowParallelLinear(8, 4, parallel=fake)


# --------------------------------------------------------------------------- partition specs
def _grid(tp: int, rank: int = 0):
    """A grid position without process groups: enough to build layers and read their specs."""
    from zoo.parallel import ParallelState

    return ParallelState(tp_size=tp, tp_rank=rank, tp_group=None, dp_size=1, dp_rank=0, dp_group=None,
                         world_size=tp, rank=rank)


def test_layers_declare_their_partition_specs():
    """Each layer states how its parameters split; GPT-2's transformers name map marks the Conv1D weights as
    stored transposed; the model-wide collection names every parameter, agrees with the tags DeepSpeed reads,
    and marks the rest replicated."""
    from zoo.checkpoint.hf.hf_io import hf_params
    from zoo.models import GPT2Config, GPT2LMHeadModel
    from zoo.parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from zoo.parallel.partition import PartitionSpec, partition_specs

    with torch.device("meta"):
        column = ColumnParallelLinear(IN, OUT, stride=3, parallel=_grid(2))
        row = RowParallelLinear(OUT, IN, parallel=_grid(2))
        embedding = VocabParallelEmbedding(VOCAB, DIM, pad_multiple=PAD_MULTIPLE, parallel=_grid(2))
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=4, n_positions=8, vocab_size=VOCAB),
                                parallel=_grid(2))
    assert partition_specs(column) == {"weight": PartitionSpec(0, 3), "bias": PartitionSpec(0, 3)}
    assert partition_specs(row) == {"weight": PartitionSpec(1), "bias": PartitionSpec()}
    assert partition_specs(embedding) == {"weight": PartitionSpec(0, vocab_rows=VOCAB)}
    specs = partition_specs(model)
    assert list(specs) == [name for name, _ in model.named_parameters()]
    stored = hf_params(model)
    assert stored["transformer.h.1.attn.c_attn.weight"].spec == PartitionSpec(0, 3, transposed=True)  # Conv1D, QKV
    assert stored["transformer.h.1.mlp.c_proj.weight"].spec == PartitionSpec(1, transposed=True)
    assert specs["transformer.wte.weight"] == PartitionSpec(0, vocab_rows=VOCAB)
    for name, param in model.named_parameters():
        tags = (param.partition_dim, param.partition_stride) if getattr(param, "tensor_model_parallel", False) else None
        assert tags == ((specs[name].dim, specs[name].stride) if specs[name].is_sharded else None), name


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_partition_spec_merges_shards_and_moves_vocab_padding(tp):
    """shard and merge are inverse at every rank; repad cuts one tp's vocab padding and adds another's (zeros);
    the file layout drops the padding and transposes where declared. Compared with torch.equal."""
    from zoo.parallel.partition import PartitionSpec

    spec = PartitionSpec(0, 3, transposed=True)
    master = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(tp))
    shards = [spec.shard(master, rank, tp) for rank in range(tp)]
    assert all(torch.equal(shard, _shard(master, 0, rank, tp, 3)) for rank, shard in enumerate(shards))
    assert torch.equal(spec.merge(shards), master)
    assert torch.equal(spec.to_file_layout(master), master.t())
    vocab = PartitionSpec(0, vocab_rows=5)
    padded = torch.cat([torch.ones(5, 2), torch.zeros(3, 2)])                       # 5 real rows, padded to 8
    assert torch.equal(vocab.repad(padded, 12), torch.cat([torch.ones(5, 2), torch.zeros(7, 2)]))
    assert torch.equal(vocab.to_file_layout(padded), torch.ones(5, 2))
    assert vocab.file_shape((8 // tp, 2), tp) == (5, 2) and spec.file_shape((OUT // tp, IN), tp) == (IN, OUT)


def test_one_sequence_parallel_predicate():
    """uses_sequence_parallel: off when not requested or at tp = 1 (whatever the length), on at tp > 1, and a
    length that does not divide by tp is the one-sentence error."""
    from zoo.parallel.layers import uses_sequence_parallel

    assert not uses_sequence_parallel(_grid(1), True, 7) and not uses_sequence_parallel(_grid(2), False, 7)
    assert uses_sequence_parallel(_grid(2), True) and uses_sequence_parallel(_grid(2), True, 8)
    with pytest.raises(ValueError, match=r"^sequence length 7 is not divisible by tensor-parallel size 2, "):
        uses_sequence_parallel(_grid(2), True, 7)
