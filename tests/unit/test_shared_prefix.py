"""Shared-prefix rows without a model (issue 43): the segments' mask, positions and THD index
against their definitions, the THD route's attention against the masked dense attention, the
segment rows the trainer builds (targets, which position predicts each, fallback to rows,
R3 routing laid out once per prompt), and ``trainer.shared_prefix`` at config load."""

from __future__ import annotations

import pytest
import torch

from megagrpo.errors import ConfigError
from megagrpo.model.model_inputs import block_causal_mask
from megagrpo.model.shared_prefix import (
    Segments,
    reference_attend,
    segment_attention,
    torch_attend,
)
from megagrpo.trainer.batch import Sample, build_samples
from megagrpo.trainer.prefix_batch import plan_units, row_budget, shared_micro_batches

# prompt 0..2 | c1 3..4 | c2 5 | a plain sample 6..8 | prompt 9..10 | c 11..13
SEG = Segments((0, 3, 5, 6, 9, 11, 14), (-1, 0, 0, -1, -1, 4))


def _brute_mask(seg: Segments) -> torch.Tensor:
    ids = seg.segment_ids().tolist()
    t = len(ids)
    see = torch.zeros(t, t, dtype=torch.bool)
    for q in range(t):
        for k in range(t):
            same = ids[q] == ids[k] and k <= q
            see[q, k] = same or seg.parent[ids[q]] == ids[k]
    return ~see


def test_mask_and_positions_follow_the_definition():
    assert torch.equal(SEG.mask()[0, 0], _brute_mask(SEG))
    assert SEG.positions().tolist() == [0, 1, 2, 3, 4, 3, 0, 1, 2, 0, 1, 2, 3, 4]
    # no parents: today's block-diagonal packed mask
    plain = Segments((0, 4, 7, 9), (-1, -1, -1))
    assert torch.equal(plain.mask(), block_causal_mask(torch.tensor([0, 4, 7, 9]), 9))
    padded = SEG.padded(16)
    assert padded.parent[-1] == -1 and padded.positions()[-2:].tolist() == [0, 1]


@pytest.mark.parametrize(
    ("cu", "parent"),
    [((0, 3, 5), (-1, 1)), ((0, 3, 5, 6), (-1, 0, 1)), ((0, 3, 2), (-1, -1)), ((0, 3), ())],
)
def test_bad_segments_are_refused(cu, parent):
    with pytest.raises(ValueError):
        Segments(cu, parent)


@pytest.mark.parametrize("attend", [reference_attend, torch_attend], ids=["dense", "buckets"])
def test_thd_route_equals_the_masked_dense_attention(attend):
    """The TE route's index (queries per segment, keys/values ``[parent; own]``,
    bottom-right causal) computes what the mask route computes, grouped-query heads too, by
    the dense stand-in and by the local spec's bucketed kernel; gradients flow back to the
    prompt's keys and values once per completion."""
    g = torch.Generator().manual_seed(0)
    t, h, hkv, d = SEG.total, 4, 2, 8
    q, k, v = (torch.randn(t, 1, n, d, generator=g, dtype=torch.float64) for n in (h, hkv, hkv))
    k.requires_grad_(True)
    out = segment_attention(torch.nn.Module(), attend, q, k, v, SEG.thd())
    kk, vv = k[:, 0].repeat_interleave(2, 1), v[:, 0].repeat_interleave(2, 1)
    scores = torch.einsum("qhd,khd->hqk", q[:, 0], kk) / d**0.5
    probs = torch.softmax(scores.masked_fill(SEG.mask()[0], float("-inf")), -1)
    want = torch.einsum("hqk,khd->qhd", probs, vv).reshape(t, 1, h * d)
    assert out.shape == (t, 1, h * d)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    (gk,) = torch.autograd.grad(out.square().sum(), k)
    (wk,) = torch.autograd.grad(want.square().sum(), k)
    torch.testing.assert_close(gk, wk, rtol=1e-10, atol=1e-12)
    idx = SEG.thd()
    assert idx.cu_kv.tolist() == [0, 3, 8, 12, 15, 17, 22] and idx.max_kv == 5


def _group_samples(prompts, completions, routing=None, group=0, start=0):
    out = []
    for j, (p, c) in enumerate(zip(prompts, completions)):
        r = None if routing is None else routing[j]
        out.append(Sample(p + c, len(p), float(j), [-0.5] * len(c), start + j, r, group=group))
    return out


def test_segment_row_targets_and_predicting_positions():
    p = [11, 12, 13]
    s = _group_samples([p] * 3, [[21, 22, 23], [31], []])
    s += [Sample([41, 42, 43, 44], 2, 9.0, [], 3, group=1)]  # a group of one: a root segment
    (mb,) = shared_micro_batches(s, budget=64, pad_to_multiple=4)
    assert mb.input_ids[0].tolist() == [11, 12, 13, 21, 22, 23, 31, 41, 42, 43, 44, 0]
    assert mb.segments is not None and mb.segments.parent == (-1, 0, 0, -1)
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 3, 0, 1, 2, 3, 0]
    assert mb.indices == [0, 1, 2, 3] and mb.spans == [(0, 0, 3), (0, 3, 4), (0, 4, 4), (0, 5, 7)]
    assert mb.target_ids[0].tolist() == [21, 22, 23, 31, 0, 43, 44]
    assert mb.loss_index is not None
    # each target is predicted from the prompt's last token or its own previous token; the
    # empty completion keeps one masked slot (its sequence id)
    assert mb.loss_index.tolist() == [2, 3, 4, 2, 6, 8, 9]
    assert mb.seq_ids is not None and mb.seq_ids[0].tolist() == [0, 0, 0, 1, 2, 3, 3]
    assert mb.mask[0].tolist() == [1, 1, 1, 1, 0, 1, 1]
    assert mb.advantages[0].tolist() == [0.0, 0.0, 0.0, 1.0, 0.0, 9.0, 9.0]
    assert mb.num_seqs == 4 and mb.num_nonempty == 3 and mb.shared_groups == (1, 1)


def test_overlong_filtered_completions_carry_no_loss_token():
    """``loss.overlong_filter``: a truncated completion stays in the row (the others attend
    to nothing of it anyway) but none of its tokens is a loss token; counted as filtered."""
    s = _group_samples([[1, 2, 3]] * 3, [[4, 5], [6, 7, 8], [9]])
    s[1].excluded = True
    (mb,) = shared_micro_batches(s, budget=64)
    assert mb.mask[0].tolist() == [1, 1, 0, 0, 0, 1]
    assert (mb.filtered_tokens, mb.filtered_nonempty, mb.num_tokens) == (3, 1, 3)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_aggregation_counts_every_sequence_like_the_rows(agg):
    """Sequence weights and Dr.GRPO's count of sequences: a row whose last completion is
    empty still counts it (the loss infers the number of sequences from their ids)."""
    from megagrpo.algo.losses import make_seq_ids
    from megagrpo.trainer.batch import micro_batches, microbatch_mass

    s = _group_samples([[1, 2, 3]] * 3, [[4, 5], [6], []])
    for i, x in enumerate(s):
        x.weight = 0.5 + i
    rows = list(micro_batches(s, 2))
    (shared,) = shared_micro_batches(s, budget=64)
    assert make_seq_ids(shared.mask.shape, shared.seq_ids, "cpu")[1] == shared.num_seqs == 3
    want = sum(microbatch_mass(mb, agg) for mb in rows)
    assert microbatch_mass(shared, agg) == pytest.approx(want)


def test_groups_fall_back_to_rows_and_are_counted():
    """A group longer than the budget, a group whose copies routed the prompt differently,
    and members answering different renderings (variants) share only where they can."""
    r = torch.randint(0, 4, (12, 2, 2), dtype=torch.int16)
    r2 = r.clone()
    r2[1, 0, 0] = (r2[1, 0, 0] + 1) % 4  # another expert for prompt token 1
    long = _group_samples([[1] * 5] * 4, [[2] * 9] * 4, group=0)
    routed = _group_samples([[3] * 4] * 2, [[4] * 3] * 2, routing=[r[:6], r2[:6]], group=1, start=4)
    variants = _group_samples([[5] * 3, [6] * 3, [5] * 3], [[7] * 2] * 3, group=2, start=6)
    units, shared, shareable = plan_units(long + routed + variants, budget=30)
    kinds = sorted((u.shared, len(u.samples)) for u in units)
    assert kinds == [(False, 1)] * 7 + [(True, 2)]  # only rendering 5 of group 2 shares
    assert (shared, shareable) == (1, 3)
    same = _group_samples([[3] * 4] * 2, [[4] * 3] * 2, routing=[r[:6], r[:6]], group=1)
    assert plan_units(same, budget=30)[1:] == (1, 1)
    assert row_budget(long, micro_batch_size=2, pack_tokens=0) == 28
    assert row_budget(long, micro_batch_size=2, pack_tokens=100) == 100


def test_routing_is_laid_out_once_per_prompt():
    """R3: the prompt's rows once (engine routing of the member that fed it), each
    completion's own rows after; a completion's last token was never fed."""
    full = torch.arange(9 * 2 * 2, dtype=torch.int16).reshape(9, 2, 2)  # prompt 4 + c 6
    a = full[:9]
    b = torch.cat([full[:4], full[4:6] + 100])[:6]  # prompt 4 + c 3
    s = _group_samples([[1] * 4] * 2, [[2] * 6, [3] * 3], routing=[a, b])
    (mb,) = shared_micro_batches(s, budget=64)
    assert mb.routing is not None and mb.routing_valid is not None
    assert torch.equal(mb.routing[0, :4], a[:4])
    assert torch.equal(mb.routing[0, 4:9], a[4:9])  # completion a: rows 4..8 fed, 9 not
    assert torch.equal(mb.routing[0, 10:12], b[4:6])
    assert mb.routing_valid[0].tolist() == [True] * 9 + [False] + [True] * 2 + [False]


def test_build_samples_number_the_groups():
    from megagrpo.types import Group, Problem

    groups = [
        Group(Problem(f"p{i}", [], ["a"]), ["x", "y"], [[1], [2]], [], prompt_ids=[5, 6])
        for i in range(2)
    ]
    samples = build_samples(groups, torch.zeros(2, 2))
    assert [s.group for s in samples] == [0, 0, 1, 1]


def _cfg(**overrides):
    from megagrpo.config.loader import load_config
    from megagrpo.trainer.config import RunConfig

    return load_config(RunConfig, [], [f"{k}={v}" for k, v in overrides.items()])


def test_config_decides_where_sharing_runs():
    cfg = _cfg()
    assert cfg.trainer.shared_prefix == "auto"
    assert cfg.shared_prefix_decision("local") == (True, "")
    on, why = cfg.shared_prefix_decision("te")
    assert not on and "has not run on a GPU" in why
    assert _cfg(**{"trainer.shared_prefix": "true"}).shared_prefix_decision("te") == (True, "")
    on, why = _cfg(**{"model.lora.dropout": 0.05}).shared_prefix_decision("local")
    assert not on and "model.lora.dropout" in why
    assert not _cfg(**{"trainer.shared_prefix": "false"}).shared_prefix_decision("local")[0]


def test_config_refuses_true_where_no_group_fits_a_micro_batch():
    one = {"trainer.micro_batch_size": 1, "trainer.pack_tokens": 0}
    with pytest.raises(ConfigError, match="trainer.shared_prefix.*micro_batch_size=1"):
        _cfg(**{"trainer.shared_prefix": "true", **one})
    on, why = _cfg(**one).shared_prefix_decision("local")
    assert not on and "pack_tokens" in why
    assert _cfg(**{**one, "trainer.pack_tokens": 8192}).shared_prefix_decision("local")[0]
    with pytest.raises(ConfigError, match="trainer.shared_prefix"):
        _cfg(**{"trainer.shared_prefix": "maybe"})
    # routing replay with packed rows: only on segment rows
    with pytest.raises(ConfigError, match="model.routing_replay"):
        _cfg(**{"model.routing_replay": "r3", "trainer.pack_tokens": 4096})
    _cfg(
        **{
            "model.routing_replay": "r3",
            "trainer.pack_tokens": 4096,
            "trainer.shared_prefix": "true",
        }
    )


class _G:
    tp_size, sequence_parallel, device = 4, True, torch.device("cpu")


def test_model_inputs_of_a_segment_row():
    """Both routes: the mask (local) and the THD params (TE), each with the positions every
    token really has; the sequence-parallel tail is a root segment of its own."""
    from megagrpo.model.model_inputs import model_inputs

    ids = torch.arange(SEG.total)[None]  # 14 tokens: padded to 16 under SP over 4
    x = model_inputs(_G(), "local", ids, segments=SEG, route="mask")  # type: ignore[arg-type]
    tail = SEG.padded(16)
    assert x.input_ids.shape == (1, 16) and x.length == 14
    assert x.attention_mask is not None and torch.equal(x.attention_mask, tail.mask())
    assert x.rope_positions is not None and torch.equal(x.rope_positions, tail.positions())
    t = model_inputs(_G(), "local", ids, SEG.positions()[None], segments=SEG)  # type: ignore[arg-type]
    params = t.extra["packed_seq_params"]
    assert t.attention_mask is None and params.qkv_format == "sbhd"
    assert params.max_seqlen_q == 16 and params.segment_thd.cu_q.tolist()[-1] == 16
    with pytest.raises(ValueError, match="segments' positions"):
        model_inputs(_G(), "local", ids, torch.arange(14)[None], segments=SEG)  # type: ignore[arg-type]


def test_install_routes_segment_rows_only_and_survives_a_copy():
    """The core attention's own forward serves every call without a segment index; a copy
    of the model routes its own modules (no reference to the original's)."""
    import copy
    from types import SimpleNamespace

    class Core(torch.nn.Module):
        tag = 1.0

        def forward(self, q, k, v, mask, attn_mask_type=None, packed_seq_params=None):
            return torch.full((q.shape[0], 1, q.shape[2] * q.shape[3]), self.tag)

    model = torch.nn.Module()
    model.self_attention = torch.nn.Module()
    model.self_attention.core_attention = Core()
    calls = []

    def attend(module, q, k, v, idx):
        calls.append(module)
        return reference_attend(module, q, k, v, idx)

    from megagrpo.model.shared_prefix import install_thd_attention

    assert install_thd_attention(model, attend) == 1
    q = torch.randn(SEG.total, 1, 2, 4)
    core = model.self_attention.core_attention
    plain = core(q, q, q, None, packed_seq_params=None)
    assert float(plain[0, 0, 0]) == 1.0 and calls == []
    params = SimpleNamespace(segment_thd=SEG.thd())
    assert core(q, q, q, None, packed_seq_params=params).shape == (SEG.total, 1, 8)
    twin = copy.deepcopy(model)
    other = twin.get_submodule("self_attention.core_attention")
    assert isinstance(other, Core)
    other.tag = 2.0
    assert float(other(q, q, q, None)[0, 0, 0]) == 2.0
    other(q, q, q, None, packed_seq_params=params)
    assert calls == [core, other]


def test_te_call_is_cross_attention_with_rounded_lengths(monkeypatch):
    """What ``te_attend`` hands TE 2.11 (no TE on CPU: a stand-in module records the call and
    answers with the dense kernel). TE's ``UnfusedDotProductAttention`` builds a THD
    *self*-attention mask from ``cu_seqlens_q`` alone (v2.11 ``dot_product_attention/utils.py``
    ``get_padding_mask`` / ``get_full_mask``): key lengths taken equal to the query lengths,
    no bottom-right shift. The call must therefore run as cross-attention (the module and
    its three backends), restored afterwards, even when TE raises; ``max_seqlen_q/kv`` are
    rounded up to 64 as TE rounds them itself (cuDNN 9.6's fused THD bottom-right kernel)."""
    import sys
    import types

    from megagrpo.model.shared_prefix import te_attend

    # TE 2.11 DotProductAttention.__init__'s backend modules (dot_product_attention.py)
    TE_BACKENDS = ("flash_attention", "fused_attention", "unfused_attention")
    seen: list[dict] = []

    class Backend(torch.nn.Module):
        attention_type = "self"

    class FakeDPA(Backend):
        def __init__(self):
            super().__init__()
            for name in TE_BACKENDS:
                setattr(self, name, Backend())

        def forward(self, q, k, v, mask, **kw):
            types_now = [self.attention_type]
            types_now += [getattr(self, n).attention_type for n in TE_BACKENDS]
            seen.append({"types": types_now, **kw})
            if kw.get("max_seqlen_q") == 0:
                raise RuntimeError("TE refused")
            idx = SEG.thd()
            return reference_attend(self, q, k, v, idx).reshape(q.shape[0], -1)

    te_pkg = types.ModuleType("transformer_engine")
    te_pt = types.ModuleType("transformer_engine.pytorch")
    te_pt.DotProductAttention = FakeDPA  # type: ignore[attr-defined]
    te_pkg.pytorch = te_pt  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformer_engine", te_pkg)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te_pt)

    g = torch.Generator().manual_seed(1)
    t, h, d = SEG.total, 2, 4
    q, k, v = (torch.randn(t, 1, h, d, generator=g, dtype=torch.float64) for _ in range(3))
    module = FakeDPA()
    idx = SEG.thd()
    out = segment_attention(module, te_attend, q, k, v, idx)
    want = segment_attention(module, reference_attend, q, k, v, idx)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    (call,) = seen
    assert call["types"] == ["cross"] * 4
    assert call["qkv_format"] == "thd"
    assert call["attn_mask_type"] == "padding_causal_bottom_right"
    assert call["cu_seqlens_q"] is idx.cu_q and call["cu_seqlens_kv"] is idx.cu_kv
    assert (call["max_seqlen_q"], call["max_seqlen_kv"]) == (64, 64)  # longest: 5 and 5
    assert module.attention_type == "self"
    assert all(getattr(module, n).attention_type == "self" for n in TE_BACKENDS)
    idx.max_q = 0  # the stand-in raises
    with pytest.raises(RuntimeError, match="TE refused"):
        te_attend(module, q[:, 0], k[:, 0], v[:, 0], idx)
    assert [getattr(module, n).attention_type for n in TE_BACKENDS] == ["self"] * 3
    assert module.attention_type == "self"
