"""``loss.overlong_filter`` (ms-swift's ``--overlong_filter``, DAPO's overlong filtering):
completions that stopped at the length limit carry no loss token, and still count in the
normalisers (ms-swift masks ``completion_mask`` inside the loss only; its normalisers were
taken from the unfiltered mask) and in the collapse metrics (rewards are untouched)."""

from __future__ import annotations

import torch

from megagrpo.trainer.batch import BatchTotals, microbatch_weight
from megagrpo.trainer.optimize import build_micro_batches
from megagrpo.types import Group, Problem


def _group(finish: list[str]) -> Group:
    toks = [[5, 6, 7], [5, 6, 7, 8, 9], [4], [3, 3]]
    return Group(
        problem=Problem("p", [], ["a"]),
        completions=["x"] * 4,
        token_ids=toks,
        logprobs=[[-1.0] * len(t) for t in toks],
        rewards=[1.0, 0.0, 1.0, 0.0],
        prompt_ids=[1, 2],
        finish_reasons=finish,
    )


def test_truncated_completions_carry_no_loss_token_but_count():
    g = _group(["stop", "length", "stop", "length"])
    adv = [torch.tensor([1.0, -1.0, 1.0, -1.0])]
    cpu = torch.device("cpu")
    plain = build_micro_batches([g], adv, 2, 0, cpu)
    kept = build_micro_batches([g], adv, 2, 0, cpu, overlong_filter=True)
    assert sum(mb.num_tokens for mb in plain) == 3 + 5 + 1 + 2
    assert sum(mb.num_tokens for mb in kept) == 3 + 1  # the two 'length' ones masked out
    assert sum(mb.filtered_tokens for mb in kept) == 5 + 2
    assert sum(mb.filtered_nonempty for mb in kept) == 2
    for mb_p, mb_k in zip(plain, kept):  # same samples, same order; only the mask differs
        assert mb_p.indices == mb_k.indices
        torch.testing.assert_close(mb_p.input_ids, mb_k.input_ids)
    # the micro-batch weights divide by the unfiltered totals (as ms-swift's normalisers)
    totals = BatchTotals(seqs=4, nonempty=4, tokens=11)
    assert sum(microbatch_weight(mb, "token_mean", totals) for mb in kept) == 4 / 11
    assert sum(microbatch_weight(mb, "seq_mean_token_mean", totals) for mb in kept) == 2 / 4
