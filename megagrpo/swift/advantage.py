"""ms-swift's advantage flags -> megagrpo keys (used by `megagrpo from-swift`).

``--advantage_estimator`` sets two other defaults in ms-swift 4.6 (``_init_grpo`` of
``swift/arguments/rlhf_args.py`` and ``swift/megatron/arguments/megatron_args.py``, alike):

* ``scale_rewards``: ``group`` for grpo, ``none`` for rloo, ``batch`` for reinforce_plus_plus;
* ``kl_in_reward``: false for grpo, true for rloo and reinforce_plus_plus: the reference KL
  (``beta`` x the completion's sum of old - reference log-probs) is subtracted from each
  completion's reward before the advantages (``swift/rl_core/advantage.py``), and the loss
  has no KL term: megagrpo's ``loss.kl_in_reward`` (with ``loss.kl_coef`` = beta). With
  ``kl_in_reward`` false the KL is a loss term: ``loss.kl_coef`` alone.
"""

from __future__ import annotations

from megagrpo.swift.flags import EXACT, MISSING, SWIFT_DEFAULTS, Translation, _bool

ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus")
SCALE_DEFAULTS = {"grpo": "group", "rloo": "none", "reinforce_plus_plus": "batch"}
"""ms-swift's ``scale_rewards`` when not given, per ``advantage_estimator``."""
KL_IN_REWARD_DEFAULTS = {"grpo": False, "rloo": True, "reinforce_plus_plus": True}
"""ms-swift's ``kl_in_reward`` when not given, per ``advantage_estimator``."""


def translate_advantage(t: Translation) -> None:
    """``advantage_estimator``, ``scale_rewards`` (always written) and ``kl_in_reward``."""
    est = str(t.get("advantage_estimator", "grpo"))
    known = est in ESTIMATORS
    if "advantage_estimator" in t.flags:
        t.add(
            "advantage_estimator",
            EXACT if known else MISSING,
            {"loss.advantage_estimator": est} if known else {},
            "" if known else f"'{est}' is not implemented",
        )
    default = SCALE_DEFAULTS.get(est, "group")
    scale = str(t.get("scale_rewards", default))
    ok = scale in ("group", "batch", "none")
    if not ok:
        note = f"'{scale}' is not implemented"
    elif "scale_rewards" in t.flags:
        note = ""
    else:
        note = (
            f"not given: ms-swift's default for advantage_estimator {est}, '{default}' "
            "(megagrpo's dr_grpo default is none)"
        )
    t.add(
        "scale_rewards",
        EXACT if ok else MISSING,
        {"loss.advantage_scale": scale} if ok else {},
        note,
        value=scale,
    )
    _kl_in_reward(t, est)


def _kl_in_reward(t: Translation, est: str) -> None:
    given = "kl_in_reward" in t.flags
    on = _bool(t.get("kl_in_reward")) if given else KL_IN_REWARD_DEFAULTS.get(est, False)
    beta = float(t.get("beta", SWIFT_DEFAULTS["beta"]))
    if str(t.get("scale_rewards", "")) == "gdpo":
        on = False  # ms-swift turns it off under gdpo (itself refused)
    if not on:
        if given:
            t.add("kl_in_reward", EXACT, {}, "the KL is a loss term (loss.kl_coef)")
        return
    if beta == 0.0:
        t.add("kl_in_reward", EXACT, {}, "no effect: beta is 0", given=given, value=True)
        return
    why = "" if given else f"not given: ms-swift's default for advantage_estimator {est}; "
    t.add(
        "kl_in_reward",
        EXACT,
        {"loss.kl_in_reward": True},
        f"{why}beta {beta:g} x each completion's summed old - reference log-probs is taken off "
        "its reward before the advantages, and the loss has no KL term",
        given=given,
        value=True,
    )
