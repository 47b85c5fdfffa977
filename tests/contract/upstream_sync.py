"""megagrpo's :class:`~megagrpo.rollout.vllm_engine.VLLMEngine` driving vLLM 0.33.0's own
objects (``upstream_llm.upstream_llm``): every sync-side call it makes, on one engine rank of
a layout of the shipped configs (upstream_session.LAYOUTS). Runs inside the session's forked
ranks; each step's outcome on its own (``upstream_session.outcome``).

Steps, in the order a run makes them (the trainer's part is the base stream megagrpo's own
``weight_update(merge_lora=False)`` exported from a Megatron policy of the same checkpoint):

1. ``start``: the engine over the started vLLM (``apply_model(describe_model)``: names,
   experts, the expert names the loaders map, parameterless layers; the probe);
2. ``regions`` / ``block``: ``apply_model(describe_shards)`` -> ``region_fn`` for every
   streamed tensor; ``apply_model(expert_block)``;
3. ``push_sliced``: the start-up push as the shipped configs make it (each rank its regions,
   zero elsewhere, as ``Exchange.sliced`` yields them; no checksums); ``after_sliced``: the
   engine's tensors and ``param_stats`` afterwards;
4. ``sleep`` + ``push_full``: the loop's sleep at the layout's level, then a push with value
   checksums (``param_stats`` before and after, ``agree``) into the sleeping engine, which
   wakes in stages (``wake_up(["weights"])`` -> stream -> ``wake_up(["kv_cache"])``);
5. ``push_old_names`` (LoRA layouts): the stream under plain expert names (what megagrpo sent
   before B1's fix), sliced: vLLM loads no experts and must be reported (W1);
6. ``push_apply_model``: the ``sync_path="apply_model"`` variant (``model.load_weights``);
7. ``adapters`` (LoRA layouts): ``update_adapter`` from a PEFT directory (``LoRARequest``
   with a path), then twice in memory (``serve_from_memory``, ``keep_in_dummy_runs``), each
   removing the previous version (``llm_engine.remove_lora``);
8. ``repush_served`` (LoRA layouts): a merged push while an adapter is served (upstream's
   reload drops every adapter: ``reset_lora_state``) and the next request's reload of it;
9. ``generate``: rollouts through ``llm.generate`` (megagrpo's ``SamplingParams``, vLLM
   0.33's output classes around the stand-in forward) and the CPU path's request split;
   ``wake_plain``: sleep, then ``wake_up()`` with every tag;
10. ``poison``: ``apply_model(poison_weights)`` (CPU's level-2 sleep) and a push after it;
11. ``close`` (world 1, last): ``llm_engine.engine_core.shutdown`` and vLLM's
    ``destroy_model_parallel`` / ``destroy_distributed_environment``.
"""

from __future__ import annotations

from typing import Any

import torch


def engine_tensors(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the engine's parameters (the tiny model: a few hundred kB)."""
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def sliced(stream: list, needs) -> list:
    """``stream`` as ``Exchange.sliced`` hands it to this rank: the regions ``needs`` names
    (megagrpo.model.sync_transport ``bounds``), zero elsewhere; tensors it needs none of
    left out."""
    from megagrpo.model.sync_transport import bounds

    out = []
    for name, t in stream:
        regions = needs(name, tuple(t.shape))
        if regions is None:
            out.append((name, t.clone()))
        elif regions:
            full = torch.zeros_like(t)
            for r in regions:
                box = tuple(slice(s, e) for s, e in bounds(r, tuple(t.shape)))
                full[box] = t[box]
            out.append((name, full))
    return out


def _push(eng, stream: list, full: bool) -> dict[str, Any]:
    zeros = [0.0] * (len(eng.probe_token_ids) - 1)  # the stand-in forward's probe
    report = eng.update_weights(iter(stream), expected_probe=zeros, full_check=full)
    return {"tensors": report.num_tensors, "checked": report.full_check_tensors}


def _wake_state(llm) -> dict[str, Any]:
    core = llm.llm_engine.engine_core.engine_core
    worker = core.model_executor.driver_worker
    return {
        "sleeping_tags": sorted(core.model_executor.sleeping_tags),
        "pauses": list(core.scheduler.pauses),
        "prefix_resets": core.scheduler.prefix_resets,
        "backend": list(worker.sleep_mode_backend.calls),
    }


def _finite(net: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in net.parameters() if p.is_floating_point())


def _adapters(eng, engine, sent: dict) -> dict[str, Any]:
    """Two adapter versions in memory; the engine's request is loaded as the engine loop
    loads a request's adapter (the stand-in generate: ``Worker.add_lora``)."""
    from megagrpo.rollout.lora import PeftAdapter

    zeros = [0.0] * (len(eng.probe_token_ids) - 1)
    first = sent["adapter"]
    second = PeftAdapter(
        a={k: v * 2 for k, v in first.a.items()},
        b=dict(first.b),
        rank=first.rank,
        alpha=first.alpha,
    )
    seen = []
    for adapter, in_memory in ((first, False), (first, True), (second, True)):
        eng.update_adapter(adapter, expected_probe=zeros, in_memory=in_memory)
        request = eng._lora_request
        seen.append(request.lora_int_id)
    return {
        "ids": seen,
        "registered": sorted(engine.manager.list_adapters()),
        "state": engine.state(seen[-1]),
        "lora_requests": [r[2].lora_int_id for r in eng.llm.requests if r[2] is not None],
    }


def _sleep_then_push(eng, engine, base: list) -> dict[str, Any]:
    eng.sleep()
    asleep = _wake_state(eng.llm)
    asleep["finite"] = _finite(engine.net)
    pushed = _push(eng, base, True)
    return {"asleep": asleep, "pushed": pushed, "awake": _wake_state(eng.llm)}


def _old_names(eng, base: list) -> dict[str, Any]:
    """A sliced push under the plain expert names megagrpo sent before B1's fix."""
    infixes = dict(getattr(eng, "_infixes", {}) or {})
    eng._infixes = {k: "" for k in infixes}
    try:
        return _push(eng, sliced(base, eng.weight_regions()), False)
    finally:
        eng._infixes = infixes


def _apply_model_path(eng, base: list) -> dict[str, Any]:
    eng.sync_path = "apply_model"
    try:
        return _push(eng, base, True)
    finally:
        eng.sync_path = "reload_weights"


def _repush_served(eng, engine, base: list) -> dict[str, Any]:
    """A merged push while an adapter is served; what upstream's ``reset_lora_state``
    leaves, and the adapter after the probe's request (which names it) loaded it again."""
    served = eng._lora_request.lora_int_id
    runner, seen = engine.runner, []
    reset = runner.reset_lora_state

    def recording_reset() -> None:  # upstream's, recording what it leaves
        reset()
        seen.append(sorted(engine.manager.list_adapters()))

    runner.reset_lora_state = recording_reset
    try:
        _push(eng, base, True)
    finally:
        del runner.reset_lora_state
    return {"after_reload": seen, "served": served, "state": engine.state(served)}


def _generate(eng) -> dict[str, Any]:
    """Rollouts through ``llm.generate`` (vLLM 0.33's ``SamplingParams`` and output classes;
    the stand-in forward) and the CPU path's request split (``scheduler_config``)."""
    from megagrpo.types import Problem

    problem = Problem(id="p0", messages=[{"role": "user", "content": "2+2?"}], answer=["4"])
    groups = eng.generate([problem], n=2)
    prompts, params, lora_req = eng.llm.requests[-1]
    on_gpu, eng.on_gpu = eng.on_gpu, False
    try:
        calls = eng._prefill_calls(prompts)
    finally:
        eng.on_gpu = on_gpu
    keep = ("n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "logprobs")
    return {
        "token_ids": groups[0].token_ids,
        "logprobs": groups[0].logprobs,
        "finish": groups[0].finish_reasons,
        "prompt_ids": groups[0].prompt_ids,
        "params": [{k: getattr(p, k) for k in keep} for p in params],
        "lora": None if lora_req is None else lora_req.lora_int_id,
        "prefill_calls": calls,
    }


def _wake_plain(eng) -> dict[str, Any]:
    """The loop's wake after a step without an update: ``wake_up()`` (every tag)."""
    eng.sleep()
    eng.wake_up()
    return _wake_state(eng.llm)


def _poison(eng, engine, base: list) -> dict[str, Any]:
    from megagrpo.rollout.vllm_support import poison_weights

    count = eng.llm.apply_model(poison_weights)[0]
    finite = _finite(engine.net)
    _push(eng, base, True)
    return {"poisoned": count, "finite_after_poison": finite, "finite": _finite(engine.net)}


def sync_probes(engine, model: str, sent: dict, close: bool = False) -> dict[str, Any]:
    """The steps of the module docstring on ``engine`` (an ``upstream_session.Engine``);
    ``close``: end with step 11."""
    from upstream_llm import megagrpo_engine
    from upstream_session import outcome, rollout_config

    out: dict[str, Any] = {}
    box: dict[str, Any] = {}
    lora = engine.config.lora_config is not None

    def start() -> dict[str, Any]:
        eng = box["eng"] = megagrpo_engine(engine, model, rollout_config(engine.layout))
        return {
            "infixes": getattr(eng, "_infixes", None),
            "keys": len(eng.name_map.keys()),
            "sleep_level": eng.sleep_level,
        }

    out["start"] = outcome(start)
    if "eng" not in box:
        return out
    eng, base = box["eng"], sent["base"]
    out["regions"] = outcome(lambda: {n: eng.weight_regions()(n, tuple(t.shape)) for n, t in base})
    out["block"] = outcome(eng.expert_block)
    out["push_sliced"] = outcome(_push, eng, sliced(base, eng.weight_regions()), False)
    out["after_sliced"] = outcome(lambda: (engine_tensors(engine.net), eng._param_stats()))
    out["push_full"] = outcome(_sleep_then_push, eng, engine, base)
    out["after_full"] = outcome(lambda: (engine_tensors(engine.net), eng._param_stats()))
    if lora:
        out["push_old_names"] = outcome(_old_names, eng, base)
    out["push_apply_model"] = outcome(_apply_model_path, eng, base)
    if lora:
        out["adapters"] = outcome(_adapters, eng, engine, sent)
        out["repush_served"] = outcome(_repush_served, eng, engine, base)
    out["generate"] = outcome(_generate, eng)
    out["wake_plain"] = outcome(_wake_plain, eng)
    out["poison"] = outcome(_poison, eng, engine, base)
    if close:
        out["close"] = outcome(close_probe, eng)
    return out


def close_probe(eng) -> dict[str, Any]:
    """``VLLMEngine.close`` on the CPU path (the only one that tears vLLM's state down)."""
    from vllm.distributed import parallel_state

    eng.on_gpu = False
    eng.close()
    return {"tp_group": parallel_state._TP is None, "world": parallel_state._WORLD is None}
