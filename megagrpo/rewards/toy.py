"""A toy reward a tiny random model can learn in a few dozen steps (tests, smoke runs).

``toy_first_token``: 1.0 iff the completion's first sampled token id is congruent to
``residue`` modulo ``modulus`` (default 0 mod 4: about a quarter of a random model's first
tokens), else 0.0. It is a 0/1 reward, so group collapse (all 0 or, once learnt, all 1) and
the curriculum's levels move with it; learning it only needs the next-token distribution
at the end of the prompt to shift, which LoRA on attention does quickly.
"""

from __future__ import annotations


def toy_first_token(modulus: int = 4, residue: int = 0):
    """Factory: ``(completions, problem, token_ids) -> [G]`` of 0.0/1.0."""
    if modulus < 1 or not 0 <= residue < modulus:
        raise ValueError(f"need modulus >= 1 and 0 <= residue < modulus, got {modulus}, {residue}")

    def reward(completions: list[str], problem, token_ids=None) -> list[float]:
        if token_ids is None:
            raise TypeError("toy_first_token needs token_ids")
        return [1.0 if ids and int(ids[0]) % modulus == residue else 0.0 for ids in token_ids]

    return reward
