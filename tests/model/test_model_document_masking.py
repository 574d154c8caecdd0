"""Document masking in the model (``document_ids``): a packed sample of several documents gives, at every position,
the loss and (summed over documents) the gradients of the independent float64 reference run on each document alone
from position 0, the top query layer included, without recompute, with full recompute and with selective core_attn
recompute (the mask is an input of the recomputed function). Without document ids every attention is the plain
``is_causal`` SDPA call as before; with them all attentions share one (b, 1, s, s) bool mask built once per forward;
the KV-cache path takes none. The batch side (Megatron's rules) and the CLI at every layout are in
tests/training/test_document_masking.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_helpers import dense_logits, max_err, model_plan, tiny_config

from codegeex_train.layout.recompute import Recompute
from codegeex_train.model import CodeGeeXModel
from codegeex_train.training.batches import document_ids, document_position_ids

EOD = 0
# (b, s) = (2, 16): documents of 4, 3, 1 (empty: a lone EOD), 7 and 1 (unended) tokens; then 1 (a lone EOD), 7, 8.
IDS = torch.tensor([[5, 6, 7, EOD, 9, 10, EOD, EOD, 3, 4, 5, 6, 7, 8, EOD, 9],
                    [EOD, 1, 2, 3, 4, 5, 6, EOD, 8, 9, 10, 11, 12, 13, 14, 15]])
RECOMPUTE = {"none": Recompute(), "full": Recompute.full(), "selective": Recompute("selective", modules=("core_attn",))}


@pytest.mark.parametrize("recompute", list(RECOMPUTE))
def test_packed_documents_equal_each_document_alone(recompute):
    config = tiny_config(num_layers=3)
    labels = torch.randint(1, config.vocab_size, IDS.shape, generator=torch.Generator().manual_seed(1))
    weights = torch.rand(IDS.shape, generator=torch.Generator().manual_seed(2))
    docs, positions = document_ids(IDS, EOD), document_position_ids(IDS, EOD)
    model = CodeGeeXModel(config, None, model_plan(recompute=RECOMPUTE[recompute]), seed=5)
    per_token = model(IDS, positions, labels=labels, document_ids=docs)  # (b, s)
    (per_token * weights).sum().backward()

    dense = {n: p.detach().double().requires_grad_() for n, p in model.named_parameters()}
    expected = torch.empty(IDS.shape, dtype=torch.float64)
    for row in range(IDS.shape[0]):
        for doc in docs[row].unique():
            at = (docs[row] == doc).nonzero().flatten()
            logits = dense_logits(dense, config, IDS[row, at][None], torch.arange(len(at))[None])[0]
            expected[row, at] = F.cross_entropy(logits, labels[row, at], reduction="none")
    (expected * weights).sum().backward()

    assert max_err(per_token, expected) <= 1e-5
    whole = model(IDS, torch.arange(IDS.shape[1]).expand_as(IDS), labels=labels)  # no masking: far off
    assert max_err(whole, expected) > 1e-2
    for n, p in model.named_parameters():
        scale = dense[n].grad.abs().max().item()
        assert scale > 0, n
        assert max_err(p.grad, dense[n].grad) <= 1e-5 * max(1.0, scale), (recompute, n)


def test_every_attention_gets_the_one_mask_or_the_causal_path(monkeypatch):
    config = tiny_config(num_layers=2)
    model = CodeGeeXModel(config, None, None, seed=5).eval()
    calls, real = [], F.scaled_dot_product_attention

    def sdpa(q, k, v, **kw):
        calls.append(kw)
        return real(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    positions = torch.arange(IDS.shape[1]).expand_as(IDS)
    with torch.no_grad():
        model(IDS, positions)
        assert calls == [{"dropout_p": 0.0, "is_causal": True}] * 3  # 2 layers + the top query layer, as before
        calls.clear()
        model(IDS, positions, document_ids=document_ids(IDS, EOD))
        masks = [c.pop("attn_mask") for c in calls]
        assert calls == [{"dropout_p": 0.0}] * 3
        assert all(m is masks[0] for m in masks) and masks[0].shape == (2, 1, 16, 16)
        assert masks[0].dtype == torch.bool
        with pytest.raises(ValueError, match="document_ids go with training, not kv_cache"):
            model(IDS, positions, kv_cache=model.new_kv_cache(2, 16), document_ids=document_ids(IDS, EOD))
        with pytest.raises(ValueError, match="one \\(b, s\\) entry per position"):
            model(IDS, positions, document_ids=document_ids(IDS, EOD)[:, :8])
