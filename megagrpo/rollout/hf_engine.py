"""transformers ``generate`` rollout engine: same protocol as vLLM, for machines without it.

Slow (no paged KV cache, no continuous batching) but exact: it is also the reference the vLLM
engine is tested against. Per-request seeds: a logits processor samples each row with its
own ``torch.Generator`` (repetition penalty, temperature, min-p, top-k, top-p in vLLM's
order: :mod:`megagrpo.rollout.sampling`) and hands ``generate`` a one-hot choice, so
``generate`` runs greedily over our samples; log-probs come from the raw logits
(``rollout.logprobs=sampling``: from logits / temperature).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from megagrpo.rollout import base as rb
from megagrpo.rollout import verify as rv
from megagrpo.rollout.base import EngineError, SamplingSpec, SyncReport, WeightSyncError
from megagrpo.rollout.config import RolloutConfig
from megagrpo.rollout.lora import PeftAdapter
from megagrpo.rollout.routing import RoutingCapture, attach_routing, moe_routers
from megagrpo.rollout.sampling import SamplingParams, process_logits
from megagrpo.rollout.stream import SyncMeter, iter_buckets, resolve_dtype, to_checkpoint_format
from megagrpo.rollout.verify import Key, Stats, SyncVerifier, WeightEvidence
from megagrpo.types import Group, Problem

log = logging.getLogger(__name__)

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
MAX_ROWS = 64
"""Rows (prompt x sample) per ``generate`` call."""


@torch.no_grad()
def sequence_logprobs(model, token_ids: Sequence[int]) -> list[float]:
    """Log-probs ``[T - 1]`` of ``token_ids[1:]`` under an HF causal LM (float64 softmax)."""
    ids = torch.tensor([list(token_ids)], device=model.device)
    logits = model(input_ids=ids).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].tolist()


class _SeededSampler:
    """Logits processor: sample row i with generator i from the processed logits
    (:func:`megagrpo.rollout.sampling.process_logits`, vLLM's order); return a one-hot choice
    [B, V]. Keeps each chosen token's log-prob under the processed distribution (float64):
    ``rollout.logprobs=sampling`` with a truncating sampler reports those, as vLLM's
    ``processed_logprobs``."""

    def __init__(self, seeds: list[int], params: SamplingParams, prompts: list[list[int]], device):
        self.gens = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        self.params = params
        self.prompts = prompts
        self.seen: torch.Tensor | None = None
        self.chosen_logprobs: list[torch.Tensor] = []

    def _seen(self, scores: torch.Tensor) -> torch.Tensor | None:
        if self.params.repetition_penalty == 1.0:
            return None
        if self.seen is None:  # the prompt's tokens (left padding excluded)
            self.seen = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
            for i, row in enumerate(self.prompts):
                self.seen[i, torch.tensor(row, dtype=torch.long, device=scores.device)] = True
        return self.seen

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        seen = self._seen(scores)
        logits = process_logits(scores.double(), seen, self.params)
        probs = torch.softmax(logits, dim=-1).float()
        choice = torch.cat(
            [torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(self.gens)]
        )
        rows = torch.arange(len(choice), device=scores.device)
        self.chosen_logprobs.append(torch.log_softmax(logits, -1)[rows, choice].cpu())
        if seen is not None:
            seen[rows, choice] = True
        out = torch.full_like(scores, float("-inf"))
        out[rows, choice] = 0.0
        return out


class HFEngine:
    """:class:`~megagrpo.rollout.base.RolloutEngine` on transformers ``generate``."""

    name = "hf"

    def __init__(self, cfg: RolloutConfig, model_path: str, seed: int = 0) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        self.cfg = cfg
        self.model_path = str(model_path)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if cfg.quantization != "none":
            raise EngineError(
                f"rollout.quantization={cfg.quantization}: the HF engine serves the "
                "checkpoint's dtype only\n  -> set rollout.quantization=none or use engine=vllm"
            )
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            dtype = None if cfg.dtype == "auto" else resolve_dtype(cfg.dtype)
            if cfg.load_format == "dummy":  # random init: the trainer's first sync loads it
                config = AutoConfig.from_pretrained(self.model_path)
                model: Any = AutoModelForCausalLM.from_config(
                    config, dtype=dtype or getattr(config, "dtype", None) or torch.float32
                )
            else:
                model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype)
            self.model: Any = model.to(device).eval()
        except Exception as exc:
            raise EngineError(
                f"HF engine start failed: {type(exc).__name__}: {exc}\n"
                "  -> check model.hf_path and rollout.dtype"
            ) from exc
        self.dtype = next(self.model.parameters()).dtype
        self._tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        try:
            gen = GenerationConfig.from_pretrained(self.model_path)
            eos = gen.eos_token_id
        except OSError:
            eos = None
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in eos:
            eos.append(self.tokenizer.eos_token_id)
        self.eos_ids = eos
        self.pad_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos[0]
        )
        self._base_seed = int(cfg.seed) * 7919 + int(seed)
        self._calls = itertools.count()
        self._asleep = False
        self.probe_token_ids = rb.default_probe_ids(self.tokenizer, cfg.probe_len)
        self.verifier = SyncVerifier(
            rv.thresholds_for(cfg, self.dtype), cfg.full_check_every, self.probe_logprobs()
        )
        self.returns_routing = self._routing_supported()
        """Groups carry ``routing`` (:mod:`megagrpo.rollout.routing`; MoE models)."""

    def _routing_supported(self) -> bool:
        """Whether generate returns routing: ``rollout.return_routing`` (None: for MoE)."""
        if self.cfg.return_routing is False:
            return False
        if moe_routers(self.model):
            return True
        if self.cfg.return_routing:
            raise EngineError(
                "rollout.return_routing=true: the model has no MoE router this engine can "
                "capture (transformers' TopKRouter at layers.N.mlp.gate)"
            )
        return False

    def _capture(self) -> RoutingCapture:
        c = self.model.config
        return RoutingCapture(self.model, c.num_hidden_layers, c.num_experts_per_tok)

    def prompt_ids(self, problem: Problem) -> list[int]:
        """The exact prompt ids ``[P]`` (chat template, generation prompt, no extra BOS)."""
        return rb.chat_prompt_ids(self.tokenizer, problem)

    def _check_awake(self) -> None:
        if self._asleep:
            raise EngineError("rollout engine is asleep: call wake_up() before using it")

    @torch.no_grad()
    def _generate_rows(
        self,
        rows: list[list[int]],
        seeds: list[int],
        params: SamplingParams,
        max_tokens: int,
        routes: list | None = None,
    ) -> list[tuple[list[int], list[float], str]]:
        """Left-padded batch generate; returns (token_ids, logprobs, finish) per row and
        appends each row's routing to ``routes`` when given."""
        from transformers import LogitsProcessorList

        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
        dev = self.model.device
        sampler = _SeededSampler(seeds, params, rows, dev)
        capture = self._capture() if routes is not None else None
        with capture or contextlib.nullcontext():
            out = self.model.generate(
                input_ids=ids.to(dev),
                attention_mask=mask.to(dev),
                do_sample=False,
                max_new_tokens=max_tokens,
                logits_processor=LogitsProcessorList([sampler]),
                eos_token_id=self.eos_ids,
                pad_token_id=self.pad_id,
                output_logits=True,
                return_dict_in_generate=True,
                temperature=None,
                top_p=None,
                top_k=None,
            )
        new = out.sequences[:, width:].cpu()
        logits = torch.stack(out.logits, 1).double()  # [B, L, V], raw
        if self.cfg.logprobs == "sampling":  # the distribution sampled from (rollout.logprobs)
            logits = logits / params.temperature
        logp = torch.log_softmax(logits, -1).cpu()
        if self.cfg.logprobs == "sampling" and params.truncates:  # vLLM's processed_logprobs
            chosen = torch.stack(sampler.chosen_logprobs, 1)  # [B, L]
            logp = torch.zeros_like(logp).scatter_(
                -1, new[:, : chosen.shape[1], None], chosen[..., None]
            )
        results = []
        for i in range(len(rows)):
            toks, lps, finish = [], [], "length"
            for t in range(new.shape[1]):
                tok = int(new[i, t])
                toks.append(tok)
                lps.append(float(logp[i, t, tok]))
                if tok in self.eos_ids:
                    finish = "stop"
                    break
            results.append((toks, lps, finish))
        if capture is not None and routes is not None:
            routes += capture.rows([len(r) for r in rows], width, [len(r[0]) for r in results])
        return results

    def generate(
        self, problems: list[Problem], n: int | Sequence[int], sampling: SamplingSpec | None = None
    ) -> list[Group]:
        """Sample ``n`` (or ``n[j]``) completions per problem (see RolloutEngine.generate):
        one row per completion, seeded by (call seed, problem index, sample index), so a
        problem's completions do not depend on the other problems' counts."""
        self._check_awake()
        s = sampling or SamplingSpec()
        cfg = self.cfg
        call = next(self._calls)
        base = s.seed if s.seed is not None else rb.request_seed(self._base_seed, call, 0)
        if not problems:
            return []
        prompts = [self.prompt_ids(p) for p in problems]
        counts = rb.sample_counts(n, len(problems))
        rows, seeds = [], []
        for j, (ids, n_j) in enumerate(zip(prompts, counts)):
            if cfg.max_model_len - len(ids) < 1:
                raise EngineError(
                    f"problem {problems[j].id!r}: prompt of {len(ids)} tokens "
                    "leaves no room to generate; raise rollout.max_model_len"
                )
            rows += [ids] * n_j
            seeds += [rb.request_seed(base, s.problem_offset + j, i) for i in range(n_j)]
        caps = [  # per row: the call's limit, capped by its problem's own (partial rollouts)
            rb.problem_max_tokens(p, s.max_tokens or cfg.max_tokens)
            for p, n_j in zip(problems, counts)
            for _ in range(n_j)
        ]
        max_tokens = min(max(caps), cfg.max_model_len - max(len(p) for p in prompts))
        results = []
        routes: list | None = [] if self.returns_routing else None
        params = cfg.sampling_params(s.temperature, s.top_p)
        try:
            for k in range(0, len(rows), MAX_ROWS):
                results += self._generate_rows(
                    rows[k : k + MAX_ROWS], seeds[k : k + MAX_ROWS], params, max_tokens, routes
                )
        except torch.OutOfMemoryError as exc:
            raise EngineError(
                f"HF generation out of memory: {exc}\n  -> lower "
                "rollout.group_size, rollout.max_tokens"
            ) from exc
        except Exception as exc:
            raise EngineError(
                f"HF generation failed: {type(exc).__name__}: {exc}\n  -> check "
                "rollout.max_tokens, rollout.temperature, rollout.top_p"
            ) from exc
        cut = [len(r[0]) > cap for r, cap in zip(results, caps)]
        if any(cut):  # a row past its own cap ends there, as its request would
            prompt_of = [ids for ids, n_j in zip(prompts, counts) for _ in range(n_j)]
            for k in (k for k, c in enumerate(cut) if c):
                toks, lps, _ = results[k]
                results[k] = (toks[: caps[k]], lps[: caps[k]], "length")
                if routes is not None and routes[k] is not None:  # P + L - 1 rows
                    routes[k] = routes[k][: len(prompt_of[k]) + caps[k] - 1]
        groups, start = [], 0
        for j, problem in enumerate(problems):
            group = Group(
                problem=problem, completions=[], token_ids=[], logprobs=[], prompt_ids=prompts[j]
            )
            end = start + counts[j]
            for toks, lps, finish in results[start:end]:
                group.completions.append(rb.decode_completion(self.tokenizer, toks))
                group.token_ids.append(toks)
                group.logprobs.append(lps)
                group.lengths.append(len(toks))
                group.finish_reasons.append(finish)
            groups.append(group)
            start = end
        if routes is not None:
            attach_routing(groups, routes)
        return groups

    def sequence_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """Log-probs ``[T - 1]`` of ``token_ids[1:]`` under the current weights."""
        self._check_awake()
        return sequence_logprobs(self.model, token_ids)

    def probe_logprobs(self) -> list[float]:
        """Log-probs ``[probe_len - 1]`` of :attr:`probe_token_ids`."""
        return self.sequence_logprobs(self.probe_token_ids)

    def _target(self, params: dict[str, torch.Tensor], name: str):
        """(parameter name, expert, destination view) of one HF-named tensor, or None."""
        if name in params:
            return name, -1, params[name]
        m = _EXPERT.match(name)
        if m is None:
            return None
        prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
        fused = f"{prefix}.down_proj" if kind == "down" else f"{prefix}.gate_up_proj"
        target = params.get(fused)
        if target is None:
            return None
        if kind == "down":
            return fused, e, target[e]
        half = target.shape[1] // 2
        return fused, e, (target[e, :half] if kind == "gate" else target[e, half:])

    def _keys(self, params: dict[str, torch.Tensor]) -> set[Key]:
        """Every (parameter, expert) a full sync must cover (a tied LM head is optional)."""
        keys: set[Key] = set()
        for name, t in params.items():
            if self._tied and name == "lm_head.weight":
                continue
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                keys.update((name, e) for e in range(t.shape[0]))
            else:
                keys.add((name, -1))
        return keys

    def _stats(self, params: dict[str, torch.Tensor], keys: set[Key]) -> Stats:
        return {k: rv.tensor_stats(params[k[0]] if k[1] < 0 else params[k[0]][k[1]]) for k in keys}

    @torch.no_grad()
    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        expected_probe: Sequence[float] | None = None,
        expected_before: Sequence[float] | None = None,
        full_check: bool | None = None,
    ) -> SyncReport:
        """Copy HF-named tensors (fused or per-expert names) in; verify (see
        VLLMEngine.update_weights for the arguments). May be called asleep."""
        if self._asleep:
            self.wake_up()
        t0 = time.perf_counter()
        full = self.verifier.full_check_due() if full_check is None else full_check
        params = dict(self.model.state_dict(keep_vars=False))
        keys = self._keys(params)
        t_full = time.perf_counter()
        pre = self._stats(params, keys) if full else None
        t_full = time.perf_counter() - t_full
        meter = SyncMeter()
        streamed: Stats = {}
        unknown: list[str] = []
        buckets = iter_buckets(
            to_checkpoint_format(named_tensors),
            int(self.cfg.sync_bucket_mb * 2**20),
            self.dtype,
            self.model.device,
        )
        for name, tensor in meter.stream(buckets):
            if name == "lm_head.weight" and self._tied:
                continue  # the LM head is the embedding (vLLM skips it too)
            hit = self._target(params, name)
            if hit is None:
                unknown.append(name)
                continue
            try:
                hit[2].copy_(tensor)
            except RuntimeError as exc:
                raise WeightSyncError(f"HF sync: tensor {name!r}: {exc}") from exc
            rv.add_stats(streamed, (hit[0], hit[1]), rv.tensor_stats(tensor))
        t1 = time.perf_counter()
        post = self._stats(params, keys) if full else None
        evidence = WeightEvidence(keys, streamed, unknown, post, pre)
        ver = self.verifier
        predicts = ver.predicts_change(expected_probe, expected_before)
        checked = rv.check_weights(evidence, predicts, "HF sync", ver.last_streamed)
        t_full += time.perf_counter() - t1 if full else 0.0
        verdict = ver.verify(self.probe_logprobs(), expected_probe, expected_before, "HF sync")
        ver.last_streamed = streamed
        return rv.sync_report(verdict, meter, time.perf_counter() - t0, "full", checked, t_full)

    def supports_adapter_sync(self) -> bool:
        """The HF engine takes merged weights only."""
        return False

    def expert_block(self) -> tuple[int, int, int] | None:
        """Every expert (one whole model per engine)."""
        return None

    def weight_regions(self):
        """The HF engine holds every tensor whole (a sliced sync sends it everything)."""
        return None

    def update_adapter(
        self,
        adapter: PeftAdapter,
        expected_probe: Sequence[float] | None = None,
        expected_before: Sequence[float] | None = None,
        in_memory: bool = False,
    ) -> SyncReport:
        """Not supported: the HF engine takes merged weights (:meth:`update_weights`)."""
        raise EngineError(
            "the HF engine cannot serve LoRA adapters alone: set trainer.weight_sync=merged "
            "(or rollout.engine=vllm with rollout.enable_lora=true)"
        )

    @property
    def weights_dropped(self) -> bool:
        """Never: the HF engine's sleep keeps its weights."""
        return False

    def sleep(self) -> None:
        """GPU: move weights to CPU. CPU: no-op."""
        if self.model is not None and self.model.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self._asleep = True

    def wake_up(self) -> None:
        """Undo :meth:`sleep`."""
        if torch.cuda.is_available() and self.model is not None:
            self.model.to("cuda")
        self._asleep = False

    def close(self) -> None:
        """Drop the model."""
        self.model = None
