"""Length-based rewards: ``soft_overlong``, the same definition as ms-swift's ``SoftOverlong``
(``swift/rewards/orm.py``, DAPO's soft overlong punishment).

For a completion of ``L`` tokens, with ``expected = max_len - cache_len``::

    r(L) = min(-(L - expected) / cache_len, 0)

i.e. 0 up to ``expected`` tokens, then linearly down to -1 at ``max_len``; beyond ``max_len``
it keeps falling (ms-swift does not clamp). It needs token lengths, not texts: the composite
reward passes ``lengths`` to functions that accept it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from megagrpo.types import Problem


def soft_overlong_value(length: int, max_len: int, cache_len: int) -> float:
    """``min(-(length - (max_len - cache_len)) / cache_len, 0)`` for one completion."""
    exceed = length - (max_len - cache_len)
    return min(-exceed / cache_len, 0)


def soft_overlong(max_len: int = 4096, cache_len: int = 2048) -> Callable[..., list[float]]:
    """Factory: ``(completions [G], problem, lengths [G]) -> [G]`` soft overlong penalties.

    ``max_len`` is the generation limit in tokens, ``cache_len`` the length of the linear
    penalty ramp before it (ms-swift's ``soft_max_length`` / ``soft_cache_length``).
    """
    if not 0 < cache_len < max_len:
        raise ValueError(
            f"soft_overlong needs 0 < cache_len < max_len, got cache_len="
            f"{cache_len}, max_len={max_len}"
        )

    def reward(
        completions: list[str], problem: Problem, lengths: Sequence[int] | None = None
    ) -> list[float]:
        if lengths is None:
            raise TypeError("soft_overlong needs completion token lengths (lengths=None)")
        if len(lengths) != len(completions):
            raise ValueError(f"{len(completions)} completions but {len(lengths)} lengths")
        return [float(soft_overlong_value(int(n), max_len, cache_len)) for n in lengths]

    return reward
