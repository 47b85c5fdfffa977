"""Packed training rows (megagrpo.trainer.batch, model_inputs): layout against the trainer's
padded micro-batches, the block-diagonal mask against a brute-force loop, padding counts in
closed form, and bad inputs."""

from __future__ import annotations

import pytest
import torch

from megagrpo.model.model_inputs import block_causal_mask, model_inputs, packed_positions
from megagrpo.trainer.batch import Sample, micro_batches, pack_samples, padding_stats, plan_rows


def _samples(lengths: list[tuple[int, int]]) -> list[Sample]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i, (p, c) in enumerate(lengths):
        ids = torch.randint(5, 100, (p + c,), generator=g).tolist()
        lp = torch.randn(c, generator=g).tolist()
        out.append(Sample(ids, p, float(i) - 1.5, lp, i))
    return out


def test_plan_rows_first_fit_decreasing():
    # by hand, max 10: 7 opens row 0 (3 free), 6 row 1, 5 row 2; 4 fits row 1, 3 row 0, 1 row 2
    rows = plan_rows([3, 7, 5, 1, 6, 4], 10)
    assert rows == [[1, 0], [4, 5], [2, 3]]
    lens = [3, 7, 5, 1, 6, 4]
    assert sorted(i for r in rows for i in r) == list(range(6))
    assert all(sum(lens[i] for i in r) <= 10 for r in rows)
    assert rows[0][0] == 1  # the longest sample opens the first row
    assert plan_rows([3, 7, 5, 1, 6, 4], 10) == rows  # deterministic
    with pytest.raises(ValueError, match="does not fit"):
        plan_rows([11], 10)


def test_packed_rows_match_the_padded_micro_batch_per_sample():
    samples = _samples([(4, 3), (2, 6), (5, 1), (3, 3), (6, 0)])
    padded = {s.index: None for s in samples}
    for mb in micro_batches(samples, 5, pad_id=0):
        for row, idx in enumerate(mb.indices):
            padded[idx] = (mb, row)
    packed = pack_samples(samples, 16, pad_id=0, pad_to_multiple=4)
    assert sorted(i for mb in packed for i in mb.indices) == list(range(5))
    for mb in packed:
        t = mb.input_ids.shape[1]
        assert t % 4 == 0 and mb.input_ids.shape[0] == 1
        cu = mb.cu_seqlens.tolist()
        assert cu[0] == 0 and cu[-1] <= t and t - cu[-1] < 4
        assert mb.position_ids[0].tolist() == packed_positions(mb.cu_seqlens, t).tolist()
        for k, idx in enumerate(mb.indices):
            lo, hi = cu[k], cu[k + 1]
            ref, row = padded[idx]
            n = hi - lo
            assert n == samples[idx].length
            for field in ("input_ids", "target_ids", "mask", "advantages", "rollout_logprobs"):
                got = getattr(mb, field)[0, lo:hi]
                want = getattr(ref, field)[row, :n]
                assert torch.equal(got, want), (field, idx)
            assert mb.position_ids[0, lo:hi].tolist() == list(range(n))
            assert (mb.seq_ids[0, lo:hi] == k).all()
        assert mb.mask[0, cu[-1] :].sum() == 0  # tail padding carries no loss
    assert sum(mb.num_tokens for mb in packed) == sum(s.length - s.prompt_len for s in samples)
    assert sum(mb.num_seqs for mb in packed) == 5
    assert sum(mb.num_nonempty for mb in packed) == 4  # the (6, 0) sample has no completion


def test_block_causal_mask_brute_force():
    cu = torch.tensor([0, 3, 4, 7], dtype=torch.int32)
    m = block_causal_mask(cu, 9)[0, 0]
    seg = [0, 0, 0, 1, 2, 2, 2, 3, 3]  # positions 7, 8: the tail block
    for q in range(9):
        for k in range(9):
            assert bool(m[q, k]) == (k > q or seg[q] != seg[k]), (q, k)
    assert packed_positions(cu, 9).tolist() == [0, 1, 2, 0, 0, 1, 2, 0, 1]


def test_padding_stats_closed_form():
    s = padding_stats([10, 2, 2, 2], micro_batch_size=2, max_tokens=10)
    # padded: [2, 2] -> 4 slots, [2, 10] -> 20 slots; real 16
    assert s["real"] == 16 and s["padded_slots"] == 24
    assert s["padded_waste"] == pytest.approx(1 - 16 / 24)
    assert s["packed_rows"] == 2 and s["packed_fill"] == 1.0  # [10] | [2, 2, 2]


class _G:
    tp_size, sequence_parallel, device = 2, True, torch.device("cpu")


def test_model_inputs_packed_errors_and_sp_tail():
    ids = torch.arange(7).unsqueeze(0)
    cu = torch.tensor([0, 3, 7])
    x = model_inputs(_G(), "local", ids, cu_seqlens=cu)  # type: ignore[arg-type]
    assert x.input_ids.shape == (1, 8) and x.length == 7 and x.padded
    assert x.attention_mask is not None and x.attention_mask.shape == (1, 1, 8, 8)
    assert bool(x.attention_mask[0, 0, 7, 6])  # the SP pad token sees no real token
    with pytest.raises(ValueError, match="one row"):
        model_inputs(_G(), "local", ids.expand(2, 7), cu_seqlens=cu)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-decreasing"):
        model_inputs(_G(), "local", ids, cu_seqlens=torch.tensor([0, 5, 3]))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="restart"):
        model_inputs(_G(), "local", ids, torch.arange(7)[None], cu_seqlens=cu)  # type: ignore[arg-type]
