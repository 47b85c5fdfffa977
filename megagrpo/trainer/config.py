"""The run config: ``TrainerConfig`` (owner: megagrpo.trainer) and ``RunConfig``, the root that
nests every component's config (mirrored by configs/*.yaml)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from megagrpo.algo.config import LossConfig
from megagrpo.curriculum.config import BudgetConfig, CurriculumConfig, DynamicSamplingConfig
from megagrpo.data.config import DataConfig
from megagrpo.data.truncation import resolve_max_prompt_tokens
from megagrpo.errors import (
    ConfigError,
    name_problem,
    require,
    require_choice,
    require_finite,
    require_fp32,
)
from megagrpo.gate import compat
from megagrpo.gate.sync_exactness import refuse_lossy_at_load
from megagrpo.metrics.config import MetricsConfig
from megagrpo.model.config import ModelConfig, SyncTransport
from megagrpo.parallel.config import ClusterConfig, ParallelConfig
from megagrpo.rewards.config import RewardsConfig, resolve_soft_overlong
from megagrpo.rollout.config import RolloutConfig, WeightSync
from megagrpo.rollout.verify import thresholds_for

log = logging.getLogger(__name__)

AdapterTransport = Literal["streamed", "peft_dir"]


@dataclass
class TrainerConfig:
    """Optimisation, batching and run bookkeeping of `megagrpo train`."""

    name: str = "run"
    """Run name: outputs go to {output_dir}/{name}."""
    output_dir: str = "runs"
    """Parent directory of run directories."""
    max_steps: int = 10
    """Optimiser steps of the whole run (ms-swift's ``max_steps`` / ``train_iters``): one
    metrics row each. A batch is generated every ``mini_batches x ppo_epochs`` of them."""
    batch_groups: int = 8
    """Groups (problems) per generated batch (B); each group holds rollout.group_size
    answers. Each optimiser step trains ``batch_groups / mini_batches`` of them."""
    mini_batches: int = 1
    """Optimiser steps per pass over a generated batch (ms-swift's ``steps_per_generation``):
    the batch is split into this many mini-batches of consecutive groups, each one optimiser
    step; behaviour (old) and reference log-probs of every mini-batch are computed before the
    first update, so the later mini-batches train off-policy and the clipped ratio bounds
    how far they move. Must divide ``batch_groups``."""
    micro_batch_size: int = 4
    """Sequences per forward/backward micro-batch: activation memory is bounded by this and
    rollout.max_tokens, never by the batch size (gradients accumulate over micro-batches)."""
    ppo_epochs: int = 1
    """Passes over each generated batch (ms-swift's ``num_iterations``, the GRPO paper's
    mu): ``mini_batches x ppo_epochs`` optimiser steps per generated batch, each counted in
    ``max_steps`` (>1 needs old log-probs: recomputed)."""
    old_logprobs: Literal["auto", "rollout", "recompute", "none"] = "recompute"
    """recompute | rollout | auto | none. Behaviour log-probs for the ratio. recompute (the
    default, as ms-swift, verl and NeMo-RL): a trainer forward before the update, so an
    on-policy step has a ratio of exactly 1 and clipping never acts on inference noise; the
    engine's log-probs are still used for truncated importance sampling (``loss.tis_cap``)
    and the ``train/logprob_mismatch`` metrics. With one update per batch (ppo_epochs 1), no
    LoRA dropout and no r2 routing replay, the training forward runs under those same
    weights, so its detached log-probs serve and no extra forward runs
    (``train/old_logprobs_reused`` 1). rollout: the engine's sampled-token log-probs
    (one forward less per step, but in bf16 the ratio departs from 1 by the engine/trainer
    mismatch). auto: recompute when ppo_epochs > 1 or the engine returns none, else rollout.
    none: ratio 1 (no clipping)."""
    lr: float = 1e-4
    """AdamW learning rate of the LoRA parameters."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_betas: list[float] | None = None
    """AdamW (beta1, beta2); None: (0.9, 0.999)."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up steps (from 0 to ``lr``)."""
    warmup_ratio: float = 0.0
    """Warm-up as a fraction of the optimiser steps (ms-swift's warmup_ratio); the larger of
    this and ``warmup_steps`` applies."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """constant | linear | cosine: the learning rate after warm-up, over the max_steps
    optimiser steps, from ``lr`` down to ``min_lr`` (transformers' schedulers).
    ms-swift's default is cosine; constant keeps early and late steps equally weighted."""
    min_lr: float = 0.0
    """Floor of the linear / cosine decay (ms-swift / Megatron ``min_lr``)."""
    grad_clip: float = 1.0
    """Global grad-norm clip over the LoRA parameters (0: off)."""
    seed: int = 0
    """Seed of torch/numpy/python RNGs (per rank: seed + rank) and of the rollout engine."""
    save_every: int = 0
    """Checkpoint every N steps (0: only at the end); always at the last step."""
    keep_checkpoints: int = 2
    """Keep the newest N checkpoints (older ones are deleted after a successful save). With
    2 or more, --resume falls back to the previous one when the newest is damaged."""
    max_nonfinite_steps: int = 3
    """Stop the run after this many consecutive steps whose loss or gradient norm was
    non-finite (each such step skips its optimiser update and logs train/skipped_nonfinite)."""
    eval_every: int = 0
    """Evaluate on data.eval every N steps (0: never; also at the end when > 0)."""
    eval_max_problems: int = 0
    """Evaluate on at most this many held-out problems (0: all)."""
    eval_at_start: bool = False
    """Also evaluate before the first update (a metrics row at step 0 holding the eval/*
    figures of the base model), when eval_every > 0 and the run starts from scratch."""
    export_adapter: bool = True
    """At the end, also write a PEFT adapter (runs/<name>/adapter) that peft and vLLM load."""
    pack_tokens: int = 0
    """Pack samples into rows of at most this many tokens, one row per micro-batch
    (padding-free; must be >= rollout.max_model_len); 0: padded micro-batches of
    micro_batch_size samples."""
    shared_prefix: Literal["auto", "true", "false"] = "auto"
    """auto | true | false. Compute each group's prompt once in every training forward
    (policy, old and reference log-probs): the group trains as one row ``[prompt | c_1 | ... |
    c_G]``, each completion attending to the prompt and to itself, its positions continuing
    from the prompt's end (megagrpo.trainer.prefix_batch), several groups to a micro-batch of
    at most pack_tokens tokens (else micro_batch_size x the longest sample); a group longer
    than that trains as rows (``train/shared_prefix_fraction``). The same loss, log-probs and
    gradients as the rows, to rounding. auto: on where that is tested (the local spec, LoRA
    dropout 0), the reason printed once where it is off; true: also with the TE spec (not yet
    run on a GPU: a warning) and LoRA dropout (one dropout mask for the shared prompt);
    false: rows."""
    weight_sync: WeightSync = "auto"
    """auto | merged | adapter. merged: stream base + LoRA merged HF tensors into the engine
    every step (works for every engine and target, but a bf16 base keeps only part of a small
    update: ``sync/lora_survival``); adapter: write the PEFT adapter (a few MB) and let the
    engine serve it on its base weights, exactly (needs rollout.enable_lora and vLLM LoRA
    support for the targeted modules). auto: adapter where the engine serves LoRA, else
    merged. Both are verified against the trainer's probe log-probs."""
    allow_lossy_sync: bool = False
    """Start a run whose weight sync is lossy: a merged sync into a bf16 / fp16 / FP8 engine
    that keeps only part of the LoRA update, so the engines sample another policy than the
    one trained (:mod:`megagrpo.model.survival` predicts how much arrives at steps 1, 10 and
    50 from the lr, warm-up, LoRA rank / alpha and the weights' scales). False (default):
    such a run is refused at load and at start, naming the predicted survival;
    ``weight_sync: merged`` alone is not consent. Measured at every sync as
    ``sync/lora_survival`` (a warning below 0.9)."""
    sync_transport: SyncTransport = "allreduce"
    """allreduce | broadcast | sliced: how merged tensors travel between the trainer's ranks
    (:func:`megagrpo.model.weights.export_hf_tensors`). allreduce: every rank zero-fills each
    full tensor and sums it over its model-parallel group (2x the tensor's bytes per rank on a
    ring); broadcast: each owner broadcasts its pieces (1x); sliced: each rank receives only
    the regions its own engine holds (vLLM's TP / EP shard, the whole tensor for an HF engine,
    nothing on a rank without an engine), point to point, and the engine's per-tensor
    checksums are skipped (the probe still verifies). Every transport yields the same values.
    Merged syncs only (``weight_sync: merged``, and the base push of ``rollout.load_format:
    dummy``); an adapter sync travels as ``adapter_transport`` says."""
    adapter_transport: AdapterTransport = "streamed"
    """streamed | peft_dir: how an adapter sync reaches the engines. streamed: the owner ranks
    write their LoRA shards in the engines' dtype into flat buckets, one collective per bucket
    delivers the full factors to the engine ranks (a reduce to rank 0 for one engine, an
    all-reduce for engine replicas), and vLLM takes them in memory; peft_dir: an fp32 gather
    (two all-reduces per tensor), a PEFT directory written and read back on rank 0, the adapter
    pickled to every engine rank, each writing its own directory for vLLM to load. The engines
    serve the same values either way; both are verified against the trainer's probe."""
    offload_during_rollout: bool = False
    """Move the frozen Megatron weights and the optimiser's moments to (pinned) host memory
    while the engines generate and sync, and back before training (the LoRA parameters stay on
    the device: the adapter sync reads them). Phase order: :mod:`megagrpo.placement.offload`.
    On CPU the move is a no-op."""

    @property
    def num_warmup_steps(self) -> int:
        """Warm-up optimiser steps: ``warmup_steps`` or ``warmup_ratio`` of all of them."""
        return max(self.warmup_steps, math.ceil(self.warmup_ratio * self.max_steps))

    @property
    def updates_per_batch(self) -> int:
        """Optimiser steps per generated batch: ``mini_batches x ppo_epochs``."""
        return self.mini_batches * self.ppo_epochs

    def resolved_old_logprobs(self, engine_has_logprobs: bool = True) -> str:
        """The behaviour log-prob source actually used (see ``old_logprobs``)."""
        if self.old_logprobs != "auto":
            return self.old_logprobs
        several = self.updates_per_batch > 1
        return "recompute" if several or not engine_has_logprobs else "rollout"

    def validate(self, path: str = "trainer") -> None:
        """Check values; raises ConfigError naming the key."""
        why = name_problem(self.name)
        require(why is None, f"{path}.name", f"{self.name!r} {why}: it names the run's directory")
        require(self.max_steps >= 1, f"{path}.max_steps", "must be >= 1")
        require(self.batch_groups >= 1, f"{path}.batch_groups", "must be >= 1")
        require(self.micro_batch_size >= 1, f"{path}.micro_batch_size", "must be >= 1")
        require(self.ppo_epochs >= 1, f"{path}.ppo_epochs", "must be >= 1")
        require(
            1 <= self.mini_batches <= self.batch_groups
            and self.batch_groups % self.mini_batches == 0,
            f"{path}.mini_batches",
            f"must divide batch_groups={self.batch_groups} (got {self.mini_batches}): each "
            "optimiser step trains batch_groups / mini_batches groups",
        )
        require_choice(self, "old_logprobs", path)
        require(
            not (self.updates_per_batch > 1 and self.old_logprobs in ("none", "rollout")),
            f"{path}.old_logprobs",
            "several optimiser steps per generated batch (ppo_epochs or mini_batches > 1) "
            "need 'recompute' (or 'auto'): the old log-probs are those before the first step",
        )

        for key in ("lr", "weight_decay", "grad_clip", "min_lr"):
            require_fp32(getattr(self, key), f"{path}.{key}")
        require(self.lr > 0, f"{path}.lr", "must be > 0")
        require(self.weight_decay >= 0, f"{path}.weight_decay", "must be >= 0")
        require_choice(self, "shared_prefix", path)
        require_choice(self, "weight_sync", path)
        require_choice(self, "sync_transport", path)
        require_choice(self, "adapter_transport", path)
        require(
            self.adam_betas is None or len(self.adam_betas) == 2,
            f"{path}.adam_betas",
            "must be [beta1, beta2]",
        )
        for i, beta in enumerate(self.adam_betas or []):
            require_finite(beta, f"{path}.adam_betas.{i}")
            require(0.0 <= beta < 1.0, f"{path}.adam_betas.{i}", f"must be in [0, 1), got {beta}")
        require(self.warmup_steps >= 0, f"{path}.warmup_steps", "must be >= 0")
        require_finite(self.warmup_ratio, f"{path}.warmup_ratio")
        require(0.0 <= self.warmup_ratio < 1.0, f"{path}.warmup_ratio", "must be in [0, 1)")
        require_choice(self, "lr_schedule", path)
        require_finite(self.min_lr, f"{path}.min_lr")
        require(0.0 <= self.min_lr <= self.lr, f"{path}.min_lr", "must be in [0, lr]")
        require(self.grad_clip >= 0, f"{path}.grad_clip", "must be >= 0")
        for key in ("save_every", "eval_every", "eval_max_problems"):
            require(getattr(self, key) >= 0, f"{path}.{key}", "must be >= 0")
        require(self.keep_checkpoints >= 1, f"{path}.keep_checkpoints", "must be >= 1")
        require(self.max_nonfinite_steps >= 1, f"{path}.max_nonfinite_steps", "must be >= 1")


@dataclass
class RunConfig:
    """Everything a `megagrpo train` run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    dynamic: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "rollout.budget": "budget.mode",
        "rollout.min_samples": "budget.min_samples",
        "rollout.max_samples": "budget.max_samples",
        "rollout.round_samples": "budget.round_samples",
        "rollout.trained_size": "budget.trained_size",
        "rollout.budget_objective": "budget.objective",
        "rollout.budget_price": "budget.price",
        "rollout.sequential_gate": "budget.sequential_gate",
        "rollout.advantage_baseline": "budget.advantage_baseline",
    }
    """Old key -> its new name: the loader refuses an old key with a ConfigError naming both."""

    def validate(self, path: str = "") -> None:
        """Checks across sections (each section validated itself first): the rollout budget
        keys, and that a budget other than uniform runs with a dynamic-sampling policy that
        trains on the groups it finished (partial | carry). ConfigError names the key."""
        self.curriculum_signal()
        budget = self.budget
        budget.resolved(self.rollout.group_size, "budget")
        require(
            budget.mode == "uniform" or self.loss.advantage_estimator == "grpo",
            "loss.advantage_estimator",
            f"{self.loss.advantage_estimator} needs groups of one size (budget.mode=uniform)",
        )
        require(
            self.loss.advantage_estimator == "grpo" or budget.advantage_baseline != "pool",
            "loss.advantage_estimator",
            f"{self.loss.advantage_estimator} is its own baseline (the other answers of the "
            "trained group); budget.advantage_baseline=pool is another (Reinforce-Ada's, "
            "grpo's normalisation over every answer generated for the problem): use one, "
            "budget.advantage_baseline=group or loss.advantage_estimator=grpo",
        )
        require(
            not self.loss.kl_in_reward or budget.advantage_baseline != "pool",
            "loss.kl_in_reward",
            "the pooled baseline (budget.advantage_baseline=pool) is taken over rewards "
            "without the KL: use budget.advantage_baseline=group",
        )
        if budget.mode != "uniform" and self.dynamic.policy == "original":
            raise ConfigError(
                f"config key 'dynamic.policy': 'original' (ms-swift's fallback: train on the "
                f"first round, collapsed groups included) has no meaning with "
                f"budget.mode={budget.mode} (groups of different sizes); use partial or "
                "carry"
            )

    def curriculum_signal(self) -> str:
        """The reward term the curriculum and the collapse metrics judge correctness on
        (``curriculum.signal_reward``, or the only reward function); ConfigError when it is
        not one of the configured terms or several terms leave it unnamed."""
        labels = [f.label or f.name for f in self.rewards.functions]
        named = self.curriculum.signal_reward
        if named:
            require(
                named in labels,
                "curriculum.signal_reward",
                f"{named!r} is not a configured reward function {labels}",
            )
            return named
        require(
            len(labels) <= 1,
            "curriculum.signal_reward",
            f"{len(labels)} reward functions {labels}: name the one whose 0/1 values are the "
            "curriculum's correctness signal (problems are retired on it)",
        )
        return labels[0] if labels else ""

    def resolve(self) -> None:
        """Fill the derived values in place, once, before the config is saved (the saved
        config.yaml is then what runs): the loss aggregation and advantage scaling of the
        variant (``auto``), the Dr.GRPO normaliser (every micro-batch must share it: the
        generation budget ``rollout.max_tokens``), and bundled data paths
        (``megagrpo/assets/...`` found inside the installed package from any directory), the
        soft overlong reward's ``max_len`` (``rollout.max_tokens`` unless given; a longer one
        is an error) and the prompt budget (``data.max_prompt_tokens``). Then the
        compatibility gate (:mod:`megagrpo.gate.compat`: the pinned vLLM / megatron-core /
        TE rules, on ``cluster``'s GPUs; CompatError lists every violation). Idempotent."""
        self.loss.loss_agg = self.loss.resolved_loss_agg()
        self.loss.advantage_scale = self.loss.resolved_advantage_scale()
        if self.loss.loss_agg == "seq_mean_token_sum_norm" and self.loss.max_tokens == 0:
            self.loss.max_tokens = self.rollout.max_tokens
        self.data.train = [bundled_path(p) for p in self.data.train]
        self.data.eval = [bundled_path(p) for p in self.data.eval]
        self.rewards = resolve_soft_overlong(self.rewards, self.rollout.max_tokens)
        self.data.max_prompt_tokens = resolve_max_prompt_tokens(
            self.data, self.rollout.max_model_len, self.rollout.max_tokens
        )
        self._resolve_sync_thresholds()
        refuse_lossy_at_load(self, compat.read_hf_config(self.model.hf_path))
        self._check_routing_replay()
        self._check_shared_prefix()
        self._resolve_partial()
        self._resolve_separate()
        require(
            self.trainer.pack_tokens == 0 or self.trainer.pack_tokens >= self.rollout.max_model_len,
            "trainer.pack_tokens",
            f"must be 0 or >= rollout.max_model_len={self.rollout.max_model_len} (a sample "
            "must fit one packed row)",
        )
        compat.enforce(self, compat.read_hf_config(self.model.hf_path))

    def reuses_training_forward(self) -> bool:
        """True when recomputed old log-probs need no forward of their own: one optimiser
        update per generated batch (``trainer.mini_batches`` and ``ppo_epochs`` 1), no LoRA
        dropout (the training forward then equals the scoring forward), no r2 routing replay
        (which records the old forward's routing) and no ``loss.kl_in_reward`` (the rewards
        need the old log-probs before training). The training forward's detached log-probs
        are then the behaviour log-probs (:func:`megagrpo.trainer.optimize.prepare_update`).
        The one rule for the trainer and the planner (:meth:`no_grad_forwards`)."""
        return (
            self.trainer.updates_per_batch == 1
            and self.model.lora.dropout == 0
            and self.model.routing_replay != "r2"
            and not self.loss.kl_in_reward
        )

    def no_grad_forwards(self, engine_logprobs: bool = True) -> int:
        """No-grad forwards the trainer runs per generated batch
        (:func:`megagrpo.trainer.optimize.behaviour_logprobs`): the old log-probs when they are
        recomputed and the training forward is not reused, the reference (frozen base) when
        ``loss.kl_coef`` > 0. What ``megagrpo plan-memory`` bills (scale-audit-3 finding 2)."""
        source = self.trainer.resolved_old_logprobs(engine_logprobs)
        old = source == "recompute" and not self.reuses_training_forward()
        return int(old) + int(self.loss.kl_coef > 0)

    def _check_routing_replay(self) -> None:
        """What MoE routing replay cannot run with, named at load time (not at step 1)."""
        mode = self.model.routing_replay
        if mode == "off":
            return
        require(self.parallel.pp == 1, "model.routing_replay", "not wired for parallel.pp > 1")
        require(
            self.trainer.pack_tokens == 0 or self.trainer.shared_prefix == "true",
            "model.routing_replay",
            "not with packed rows (trainer.pack_tokens) unless trainer.shared_prefix=true "
            "(its segment rows carry the routing)",
        )
        require(
            mode != "r2"
            or self.trainer.resolved_old_logprobs(engine_has_logprobs=True) == "recompute",
            "model.routing_replay",
            "r2 records the routing of the old-log-prob forward and replays it in training: "
            "set trainer.old_logprobs=recompute",
        )

    def shared_prefix_decision(self, spec: str) -> tuple[bool, str]:
        """Whether the trainer computes each group's prompt once (``trainer.shared_prefix``)
        on a model of layer spec ``spec`` (local | te), and why not when it does not."""
        mode = self.trainer.shared_prefix
        if mode == "false":
            return False, "trainer.shared_prefix=false"
        tcfg = self.trainer
        if tcfg.pack_tokens == 0 and tcfg.micro_batch_size == 1:
            return False, (
                "a micro-batch holds one sample (trainer.micro_batch_size=1, pack_tokens=0), "
                "never a prompt with its completions: set trainer.pack_tokens (>= prompt + the "
                "group's completions) or micro_batch_size >= 2"
            )
        if mode == "true":
            return True, ""
        if self.model.lora.dropout > 0:
            return False, (
                f"model.lora.dropout={self.model.lora.dropout}: the shared prompt would draw "
                "one dropout mask where the rows draw one per completion (a different gradient "
                "sample); trainer.shared_prefix=true accepts that"
            )
        if spec == "te":
            return False, (
                "the Transformer Engine route (THD, padding_causal_bottom_right) has not run "
                "on a GPU yet (tests/gpu/test_shared_prefix_gpu.py, scripts/gpu_check.sh "
                "shared_prefix); trainer.shared_prefix=true runs it"
            )
        return True, ""

    def _check_shared_prefix(self) -> None:
        """``trainer.shared_prefix: true`` on a layout that cannot share is refused."""
        if self.trainer.shared_prefix != "true":
            return
        on, why = self.shared_prefix_decision("local")
        require(on, "trainer.shared_prefix", f"true, but {why}")

    def _resolve_partial(self) -> None:
        """Partial rollouts train tokens sampled by older weights: the trainer recomputes the
        behaviour log-probs under its current weights (``trainer.old_logprobs: recompute``)
        and weights every token by its importance ratio against the engine's log-prob
        (``loss.tis_cap``, 2.0 when 0 and ``loss.tis_auto``). Uniform rounds only, no routing
        replay."""
        if not self.rollout.partial.enabled:
            return
        key = "rollout.partial.enabled"
        require(self.budget.mode == "uniform", key, "needs budget.mode=uniform")
        require(self.model.routing_replay == "off", key, "needs model.routing_replay=off")
        self._importance_correction(key)

    def _importance_correction(self, key: str) -> None:
        """Off-policy tokens (partial rollouts, one step ahead): the trainer recomputes the
        behaviour log-probs (``trainer.old_logprobs: recompute``) and weights each token by
        its importance ratio against the engine's log-prob (``loss.tis_cap``, 2.0 when 0 and
        ``loss.tis_auto``). ConfigError names ``key``."""
        require(
            self.trainer.old_logprobs in ("auto", "recompute"),
            key,
            "needs trainer.old_logprobs=recompute (or auto): the importance weights compare "
            "the trainer's log-probs with the engine's",
        )
        self.trainer.old_logprobs = "recompute"
        if self.loss.tis_cap == 0:
            require(self.loss.tis_auto, key, "needs loss.tis_cap >= 1 (or loss.tis_auto)")
            self.loss.tis_cap = 2.0
            log.info("%s: token-level importance weights on (loss.tis_cap=2.0)", key)

    def _resolve_separate(self) -> None:
        """Placement separate (:mod:`megagrpo.placement.separate`): the last
        ``rollout.engine_ranks`` processes serve engines in replicas of
        ``rollout.tensor_parallel_size`` ranks inside one node (their private world
        rendezvouses on loopback), every other process trains in any Megatron layout of its
        own. The engine runs inside its rank (vLLM ``external_launcher``): ``rollout.colocate:
        false`` would start vLLM's own executor on GPU 0 of the node, refused.
        ``rollout.max_staleness`` resolved (1 unless set); with 1 the importance correction
        of partial rollouts is on. With partial rollouts one bound counts both lags:
        ``rollout.partial.max_staleness`` must exceed ``rollout.max_staleness`` (tokens
        generated ahead lag by it already). ConfigError names the key."""
        ro = self.rollout
        if ro.placement != "separate":
            ro.max_staleness = ro.resolved_max_staleness()
            return
        tp = ro.tensor_parallel_size
        require(
            ro.engine_ranks % tp == 0,
            "rollout.engine_ranks",
            f"{ro.engine_ranks} engine processes do not make replicas of "
            f"rollout.tensor_parallel_size={tp}",
        )
        require(
            tp <= self.cluster.gpus_per_node,
            "rollout.tensor_parallel_size",
            f"{tp} > cluster.gpus_per_node={self.cluster.gpus_per_node}: with "
            "placement=separate an engine replica sits inside one node",
        )
        require(
            ro.colocate,
            "rollout.colocate",
            "placement=separate runs each engine inside its own rank (vLLM external_launcher); "
            "colocate=false would start vLLM's own executor on GPU 0 of the node",
        )
        require(
            ro.load_format == "auto",
            "rollout.load_format",
            "placement=separate: the engine ranks read their own weights (auto)",
        )
        ro.max_staleness = ro.resolved_max_staleness()
        if ro.partial.enabled and ro.max_staleness > 0:
            require(
                ro.partial.max_staleness > ro.max_staleness,
                "rollout.partial.max_staleness",
                f"must exceed rollout.max_staleness={ro.max_staleness}: one bound counts "
                "both lags, and tokens generated one step ahead already lag by it",
            )
        if ro.max_staleness > 0:
            self._importance_correction("rollout.max_staleness")

    def _resolve_sync_thresholds(self) -> None:
        """Weight-sync verification bounds for the trainer's *and* the engine's dtype (the
        engine alone knows only its own: an fp32 engine fed by a bf16 trainer would get fp32
        bounds); the loosest of the two wins unless the config sets them."""
        dtypes = [self.model.dtype]
        if self.rollout.dtype != "auto":
            dtypes.append(self.rollout.dtype)
        t = thresholds_for(self.rollout, *dtypes)
        self.rollout.verify_tol = t.max_tol
        self.rollout.verify_mean_tol = t.mean_tol
        self.rollout.verify_change_floor = t.change_floor
        low = {"bfloat16", "float16"} & set(dtypes)
        if low and self.loss.tis_cap == 0 and self.loss.tis_auto:
            self.loss.tis_cap = 2.0
            log.info(
                "%s weights: engine and trainer log-probs differ by ~0.1 per token: truncated "
                "importance sampling on (loss.tis_cap=2.0; loss.tis_auto=false turns it off)",
                "/".join(sorted(low)),
            )


def bundled_path(path: str) -> str:
    """``path`` as given, or, when it does not exist here, the same relative path inside the
    installed package's tree (``megagrpo/assets/demo_train.jsonl`` works from any directory)."""
    if Path(path).exists() or Path(path).is_absolute():
        return path
    import megagrpo

    candidate = Path(megagrpo.__file__).resolve().parent.parent / path
    return str(candidate) if candidate.exists() else path
