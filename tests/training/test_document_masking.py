"""Document masking (--reset-position-ids, --reset-attention-mask, --eod-mask-loss) as Megatron defines it.

``get_batch`` against Megatron's own loop over EOD positions, written out below; an all-EOD micro-batch's loss is
0, not 0/0. End to end through the CLI, on a corpus of short documents (several per packed sample, empty ones too):
at (TP, PP, DP) = (1, 1, 1), (2, 1, 1) with SP and selective core_attn recompute, (1, 2, 1) with full recompute and
(1, 4, 1) interleaved (v = 2: true middle ranks and middle chunks), the per-token losses of the first step equal
those of a Hugging Face GPT-2 run on each document alone (weights copied from our model, the EOD positions masked),
within 1e-5, and the 4 iterations' losses and grad norms equal the (1, 1, 1) run's within 1e-5.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from codegeex_train import pretrain
from codegeex_train.config.arguments import parse_args
from tests.harness import metrics_records, run_distributed, tiny_pretrain_args, write_indexed_dataset
from codegeex_train.training.batches import DocumentMasking, get_batch
from codegeex_train.training.engine_stage import masked_mean

EOD = 0  # the shipped tokenizer's end-of-document id
VOCAB = 8192  # the shipped tokenizer's vocabulary, already a multiple of 128: no padding logits
ITERS, MICRO_BATCHES, TOL = 4, 4, 1e-5  # 4 iterations: past the warm-up, clipping, the loss falls
FLAGS = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
SELECTIVE = ["--recompute-granularity", "selective", "--recompute-modules", "core_attn"]
# (TP, PP, DP) -> extra flags. 8 layers: (1, 4, 1) with one layer per virtual stage runs v = 2 chunks per rank.
LAYOUTS = {
    (1, 1, 1): [],
    (2, 1, 1): ["--sequence-parallel", *SELECTIVE],
    (1, 2, 1): ["--checkpoint-activations"],
    (1, 4, 1): ["--num-layers-per-virtual-pipeline-stage", "1"],
}


# --- The batch: Megatron's rules, and its loop as the reference ----------------------------------------------

def megatron_masks(tokens: torch.Tensor, eod: int):
    """Megatron's get_ltor_masks_and_position_ids with all three flags, as its loop does it: for every EOD at index
    i, queries after i lose the keys up to i and positions after i drop by i + 1 - (the previous restart)."""
    b, s = tokens.shape
    allowed = torch.ones(b, s, s, dtype=torch.bool).tril()
    positions = torch.arange(s).repeat(b, 1)
    loss_mask = torch.ones(b, s)
    loss_mask[tokens == eod] = 0.0
    for row in range(b):
        prev = 0
        for i in (tokens[row] == eod).nonzero().flatten().tolist():
            allowed[row, i + 1:, :i + 1] = False
            positions[row, i + 1:] -= i + 1 - prev
            prev = i + 1
    return allowed, positions, loss_mask


def test_get_batch_follows_megatron_and_each_flag_does_its_part_only():
    from codegeex_train.model.attention import document_attention_mask

    text = torch.tensor([[10, 11, EOD, 13, 14, EOD, EOD, 17, 18, 19],   # an empty document between two EODs
                         [EOD, 21, 22, 23, 24, 25, 26, 27, EOD, 29],    # starts and ends with an EOD input
                         [30, 31, 32, 33, 34, 35, 36, 37, 38, EOD]])    # one document (its EOD is a label only)
    tokens = text[:, :-1]
    allowed, positions, loss_mask = megatron_masks(tokens, EOD)
    cpu = torch.device("cpu")
    batch = get_batch({"text": text}, cpu, DocumentMasking(EOD, True, True, True))
    assert batch["input_ids"].tolist() == tokens.tolist() and batch["labels"].tolist() == text[:, 1:].tolist()
    assert batch["position_ids"].tolist() == positions.tolist()
    assert batch["loss_mask"].tolist() == loss_mask.tolist()
    assert torch.equal(document_attention_mask(batch["document_ids"]), allowed.unsqueeze(1))
    assert positions[0].tolist() == [0, 1, 2, 0, 1, 2, 0, 0, 1]  # spelled out once

    plain = get_batch({"text": text}, cpu)
    assert sorted(plain) == ["input_ids", "labels", "loss_mask", "position_ids"]
    for flags, changed in (((True, False, False), {"position_ids"}), ((False, True, False), {"document_ids"}),
                           ((False, False, True), {"loss_mask"}), ((False, False, False), set())):
        one = get_batch({"text": text}, cpu, DocumentMasking(EOD, *flags))
        assert {k for k in one if k not in plain or not torch.equal(one[k], plain[k])} == changed, flags


def test_an_all_eod_micro_batch_has_zero_loss_and_zero_gradient():
    losses = torch.rand(2, 5, requires_grad=True)
    batch = get_batch({"text": torch.full((2, 6), EOD)}, torch.device("cpu"), DocumentMasking(EOD, True, True, True))
    loss = masked_mean(losses, batch["loss_mask"])
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(losses.grad, torch.zeros(2, 5))
    mask = torch.tensor([[1.0, 0, 1, 1, 0], [0, 0, 0, 0, 1]])  # otherwise the plain masked mean
    assert masked_mean(losses, mask).item() == pytest.approx((losses * mask).sum().item() / 4, rel=1e-6)


# --- End to end: the CLI at every layout against HF GPT-2 on each document alone ------------------------------

@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> str:
    """1200 documents of 0-12 random ids, each ended by EOD: a 33-token sample packs several (empty ones too)."""
    rng = np.random.default_rng(0)
    docs = [[*rng.integers(1, VOCAB, size=rng.integers(0, 13)).tolist(), EOD] for _ in range(1200)]
    prefix = tmp_path_factory.mktemp("short_docs") / "docs"
    write_indexed_dataset(prefix, docs)
    return str(prefix)


def masking_args(data, save, tp, pp, extra):
    # A GPT-2 (no top query layer, GPT-2's gelu): HF runs the same model. Larger weights than the default 0.02
    # make attention far from uniform, so a leak across documents shows.
    return tiny_pretrain_args(data, str(save), ITERS, "--num-layers", "8", "--no-top-query-layer",
                              "--activation", "gelu_tanh", "--init-method-std", "0.1", "--clip-grad", "0.5",
                              "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                              *FLAGS, *extra)


def train_and_record(topology, argv):
    """``pretrain.main``; returns the model's initial state dict (PP 1, TP 1 only) and, on the last stage's TP rank 0,
    the raw (b, s + 1) tokens, per-token losses and loss masks of the first step's micro-batches, in order."""
    from codegeex_train.training import engine_stage as stage

    texts, losses, masks, initial = [], [], [], {}
    real_get_batch, real_mean, real_train = stage.get_batch, stage.masked_mean, pretrain.train

    def get_batch_(batch, device, *rest):
        texts.append(batch["text"].numpy().copy())
        return real_get_batch(batch, device, *rest)

    def masked_mean_(loss_per_token, loss_mask):
        losses.append(loss_per_token.detach().numpy().copy())
        masks.append(loss_mask.numpy().copy())
        return real_mean(loss_per_token, loss_mask)

    def train(run, *args, **kwargs):
        if topology.tp_size == topology.pp_size == 1:
            initial.update({k: v.detach().clone() for k, v in run.engine.module.state_dict().items()})
        return real_train(run, *args, **kwargs)

    stage.get_batch, stage.masked_mean, pretrain.train = get_batch_, masked_mean_, train
    pretrain.main(argv)
    if not (topology.is_last_stage and topology.tp_rank == 0):
        return None
    return {"texts": texts[:MICRO_BATCHES], "losses": losses[:MICRO_BATCHES], "masks": masks[:MICRO_BATCHES],
            "initial": initial}


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory, short_documents):
    """(TP, PP, DP) -> (metrics by iteration, the last stage's record), one spawn per layout."""
    root, out = tmp_path_factory.mktemp("doc_masking"), {}
    for (tp, pp, dp), extra in LAYOUTS.items():
        save = root / f"tp{tp}pp{pp}dp{dp}"
        ranks = run_distributed(train_and_record, world_size=tp * pp * dp, tp_size=tp, pp_size=pp, deadline_s=600,
                                argv=masking_args(short_documents, save, tp, pp, extra))
        out[(tp, pp, dp)] = metrics_records(save), next(r for r in ranks if r is not None)
    return out


def hf_gpt2(initial: dict, argv: list[str]):
    """The (1, 1, 1) run's initial weights in a ``GPT2LMHeadModel``."""
    from transformers import GPT2LMHeadModel

    from codegeex_train.formats.huggingface.gpt2 import full_to_hf_gpt2, hf_gpt2_config

    config = parse_args(argv).model
    config.vocab_size = VOCAB
    model = GPT2LMHeadModel(hf_gpt2_config(config)).eval()
    model.load_state_dict(full_to_hf_gpt2({k: torch.from_numpy(v) for k, v in initial.items()}, config))
    return model


@torch.no_grad()
def reference_losses(model, text: np.ndarray, per_document: bool = True) -> np.ndarray:
    """(b, s) per-token losses of ``text`` (b, s + 1): each document of a row (its tokens up to and including its
    EOD) run alone from position 0, or (``per_document`` False) the whole packed row as one sequence."""
    text = torch.from_numpy(text).long()
    tokens, labels = text[:, :-1], text[:, 1:]
    out = torch.empty(tokens.shape)
    for row in range(tokens.shape[0]):
        ends = (tokens[row] == EOD).nonzero().flatten().tolist() if per_document else []
        bounds = [0, *[i + 1 for i in ends if i + 1 < tokens.shape[1]], tokens.shape[1]]
        for start, end in zip(bounds, bounds[1:]):
            logits = model(input_ids=tokens[row:row + 1, start:end]).logits[0]  # positions 0 .. end - start - 1
            out[row, start:end] = torch.nn.functional.cross_entropy(logits, labels[row, start:end], reduction="none")
    return out.numpy()


@pytest.fixture
def one_torch_thread():
    """The HF reference runs in this process: its tiny matrix products on one intra-op thread, as in the ranks (two
    threads waiting on each other on a busy 2-core machine made it ~30x slower: 22 s against 0.7 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_per_token_losses_equal_hf_gpt2_on_each_document_and_layouts_agree(layout_runs, short_documents,
                                                                          one_torch_thread):
    base, base_record = layout_runs[(1, 1, 1)]
    model = hf_gpt2(base_record["initial"], masking_args(short_documents, "x", 1, 1, []))
    assert base[ITERS]["loss"] < base[1]["loss"]  # it learns
    texts = base_record["texts"]
    references = [reference_losses(model, t) for t in texts]
    # The packed samples hold several documents, and mixing them would be seen: the loss of HF on the whole row
    # moves far beyond the tolerance wherever a document does not start the row.
    assert all((t[:, :-1] == EOD).sum() >= 2 * len(t) for t in texts)
    leak = max(np.abs(reference_losses(model, t, per_document=False) - r).max() for t, r in zip(texts, references))
    assert leak > 1e-2, leak
    eod_masked = [(t[:, :-1] != EOD).astype(np.float32) for t in texts]

    for layout, (run, record) in layout_runs.items():
        for mb in range(MICRO_BATCHES):  # every layout read the same micro-batches
            assert np.array_equal(record["texts"][mb], texts[mb]), (layout, mb)
            assert np.array_equal(record["masks"][mb], eod_masked[mb]), (layout, mb)
            worst = np.abs(record["losses"][mb] - references[mb]).max()  # every position, masked ones too
            assert worst < TOL, (layout, mb, worst)
        # The logged loss of step 1: the micro-batches' means over the positions whose input is not EOD.
        means = [(r * m).sum() / m.sum() for r, m in zip(references, eod_masked)]
        assert run[1]["loss"] == pytest.approx(float(np.mean(means)), rel=TOL), layout
        assert sorted(run) == list(range(1, ITERS + 1)), layout
        for it in range(1, ITERS + 1):
            for key in ("loss", "grad_norm"):
                assert run[it][key] == pytest.approx(base[it][key], rel=TOL), (layout, it, key)
