"""Which error `megagrpo.parallel.launch` raises when ranks fail (issue 14.9, red-team D8).

The records are what ``_entry`` writes for a failing rank; the end-to-end case (a real
2-rank export with a missing shard) is in tests/distributed/test_convert_errors.py."""

from __future__ import annotations

import pytest

from megagrpo.errors import CheckpointError, ConfigError, MegagrpoError
from megagrpo.parallel.launch import rank_failure


def record(type_: str, message: str, t: float, user: bool) -> dict:
    return {
        "error": f"Traceback (most recent call last):\n  ...\n{type_}: {message}\n",
        "type": type_,
        "message": message,
        "user_error": user,
        "time": t,
    }


GLOO = "[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4321"


def test_user_error_of_another_rank_wins_over_rank0s_secondary_gloo_error():
    # Red-team row 71: rank 1 misses its shard; rank 0 then fails in the next collective.
    failed = {
        0: record("RuntimeError", GLOO, 10.2, False),
        1: record(
            "CheckpointError", "ckpt: shard file 'dense_tp1_pp0.safetensors' missing", 10.0, True
        ),
    }
    exc = rank_failure(failed)
    assert type(exc) is CheckpointError  # the CLI maps it to exit status 2
    msg = str(exc)
    assert msg.startswith("rank 1: ckpt: shard file 'dense_tp1_pp0.safetensors' missing")
    assert f"rank 0: RuntimeError: {GLOO}" in msg  # every rank's own error is reported


def test_user_error_wins_even_when_it_is_reported_later():
    failed = {
        0: record("RuntimeError", GLOO, 1.0, False),
        1: record("ConfigError", "config key 'parallel.tp': nope", 2.0, True),
    }
    assert type(rank_failure(failed)) is ConfigError


def test_earliest_user_error_first_then_the_others():
    failed = {
        0: record("CheckpointError", "shape mismatch on rank 0", 5.0, True),
        1: record("CheckpointError", "shard missing on rank 1", 4.0, True),
    }
    msg = str(rank_failure(failed))
    assert msg.startswith("rank 1: shard missing on rank 1")
    assert "rank 0: CheckpointError: shape mismatch on rank 0" in msg


def test_unknown_user_error_type_keeps_the_base_class():
    failed = {2: record("PluginError", "bad plugin", 1.0, True)}
    exc = rank_failure(failed)
    assert type(exc) is MegagrpoError and str(exc) == "rank 2: bad plugin"


def test_crash_without_user_error_is_a_runtime_error_with_the_first_traceback():
    failed = {
        0: record("RuntimeError", GLOO, 3.0, False),
        1: record("ZeroDivisionError", "division by zero", 2.0, False),
    }
    exc = rank_failure(failed)
    assert type(exc) is RuntimeError
    assert str(exc).startswith("rank 1 failed:\nTraceback")
    assert "ZeroDivisionError: division by zero" in str(exc)
    with pytest.raises(RuntimeError, match="rank 0: RuntimeError: "):
        raise exc
