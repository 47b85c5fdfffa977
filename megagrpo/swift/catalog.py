"""What from-swift knows of ms-swift 4.6, in one place: its defaults per launcher, and a status
for every field of its GRPO argument classes (``RLHFArguments`` of ``swift rlhf``,
``MegatronRLHFArguments`` of ``megatron rlhf``; tests/unit/test_swift_catalog.py walks them all
in the installed ms-swift and checks each has one).

A flag is

* **mapped** (:data:`MAPPED`): a rule of :mod:`megagrpo.swift` translates it (``=`` / ``~``);
* **harmless** (:data:`HARMLESS`, :data:`NO_EFFECT`, and :data:`DEFAULT_ONLY` at ms-swift's
  default): it changes where, how fast or with what bookkeeping ms-swift runs (logging, run
  names, hubs, checkpoints, kernels, placement), or has no effect on GRPO: reported, never
  blocks;
* **not supported** (:data:`UNSUPPORTED`, :data:`DEFAULT_ONLY` away from the default,
  :data:`RENAMED_3X` without a 4.6 equivalent): ms-swift trains something megagrpo does not
  (out of scope by design): blocks unless ``--allow-partial``;
* **unknown**: none of these (a newer ms-swift's flag, or a typo): reported as "not known to
  from-swift: check it", blocks unless ``--allow-unknown``. A flag the installed ms-swift
  declares in a logging class or under a logging / hub / checkpoint name
  (:func:`harmless_by_declaration`) is harmless without being listed, so a new
  ``--foo_exp_name`` is not a surprise.
"""

from __future__ import annotations

import re
from typing import Any

SWIFT_VERSION = "4.6.0"
"""The ms-swift whose flags and defaults these are (tests check the installed one)."""

# ----------------------------------------------------------------------------- defaults

SWIFT_DEFAULTS: dict[str, Any] = {
    "beta": 0.04,
    "temperature": 0.9,
    "lora_alpha": 32.0,
    "lora_dropout": 0.05,
    "lora_rank": 8,
    "epsilon": 0.2,
    "epsilon_high": None,
    "dynamic_sample": False,
    "max_resample_times": 3,
    "num_generations": 8,
    "max_completion_length": 512,
    "lr_schedule": "cosine",
    "target_modules": ["all-linear"],
    "truncation_strategy": "left",
}
"""ms-swift 4.6 defaults that matter for GRPO (both launchers)."""
OPTIM_DEFAULTS = {"weight_decay": 0.1, "adam_beta1": 0.9, "adam_beta2": 0.95, "seed": 42}
"""Both launchers (megagrpo: 0.0, 0.9, 0.999, 0)."""
MEGATRON_DEFAULTS = {"global_batch_size": 16, "use_vllm": True}
"""``megatron rlhf`` only (``swift/megatron/arguments/megatron_args.py``)."""
SWIFT_RLHF_DEFAULTS = {"per_device_train_batch_size": 1, "use_vllm": False}
"""``swift rlhf`` only (``swift/rlhf_trainers/args_mixin.py``, ``trainers/arguments.py``)."""


def _names(text: str) -> list[str]:
    return text.split()


def _table(groups: dict[str, str]) -> dict[str, str]:
    """``{reason: "flag flag ..."}`` -> ``{flag: reason}`` (a flag in two groups is an error)."""
    out: dict[str, str] = {}
    for reason, names in groups.items():
        for name in _names(names):
            assert name not in out, name
            out[name] = reason
    return out


# ----------------------------------------------------------------------------- mapped

MAPPED = frozenset(
    _names(
        """rlhf_type num_generations beta temperature top_p top_k min_p repetition_penalty
        epsilon epsilon_high dynamic_sample max_resample_times overlong_filter
        rollout_importance_sampling_mode rollout_importance_sampling_threshold model lora_rank
        lora_alpha lora_dropout target_modules target_parameters target_regex use_rslora bf16
        fp16 torch_dtype tensor_model_parallel_size expert_model_parallel_size
        expert_tensor_parallel_size pipeline_model_parallel_size sequence_parallel
        recompute_granularity recompute_method recompute_num_layers recompute_modules
        max_completion_length max_length truncation_strategy vllm_max_model_len use_vllm
        vllm_mode vllm_tensor_parallel_size vllm_gpu_memory_utilization vllm_max_lora_rank
        vllm_enable_expert_parallel sleep_level router_replay_mode vllm_enable_lora
        micro_batch_size per_device_train_batch_size lr learning_rate lr_decay_style
        lr_scheduler_type min_lr weight_decay adam_beta1 adam_beta2 clip_grad max_grad_norm
        seed data_seed dataset_shuffle train_dataloader_shuffle save_steps save_total_limit
        eval_steps lr_warmup_iters lr_warmup_fraction warmup_ratio warmup_steps dataset
        val_dataset columns system template model_type enable_thinking external_plugins
        reward_funcs reward_weights soft_cache_length soft_max_length cosine_min_len_value_wrong
        cosine_max_len_value_wrong cosine_min_len_value_correct cosine_max_len_value_correct
        cosine_max_len repetition_n_grams repetition_max_penalty report_to wandb_project
        wandb_exp_name run_name logging_steps log_completions global_batch_size
        gradient_accumulation_steps steps_per_generation generation_batch_size num_iterations
        loss_type importance_sampling_level tau_pos tau_neg advantage_estimator scale_rewards
        kl_in_reward train_iters max_steps num_train_epochs max_epochs tuner_type
        offload_model offload_optimizer moe_expert_capacity_factor async_generate"""
    )
)
"""Flags a rule of :mod:`megagrpo.swift` translates (tests/unit/test_swift_catalog.py gives
each one to the translator)."""

# ----------------------------------------------------------------------------- not supported

UNSUPPORTED: dict[str, str] = {
    "async_generate": "asynchronous generation with the previous step's weights",
    "vllm_server_host": "an external vLLM server (vllm_mode server)",
    "vllm_server_port": "an external vLLM server (vllm_mode server)",
    "vllm_server_base_url": "an external vLLM server (vllm_mode server)",
    "multi_turn_scheduler": "multi-turn rollouts",
    "gym_env": "gym environments",
    "max_turns": "multi-turn rollouts",
    "reward_model": "reward models (megagrpo: reward functions only)",
    "reward_model_plugin": "reward models (megagrpo: reward functions only)",
    "teacher_model": "on-policy distillation from a teacher",
    "teacher_model_server": "on-policy distillation from a teacher",
    "max_pixels": "images (megagrpo trains text-only models)",
    "quant_method": "quantised base weights (QLoRA)",
    "quant_bits": "quantised base weights (QLoRA)",
    "bnb_4bit_quant_type": "quantised base weights (QLoRA)",
    "delta": "two-sided clipping of the ratio (delta)",
    "off_policy_sequence_mask_delta": "off-policy sequence masking",
    "chord_sft_dataset": "CHORD (an SFT loss mixed into GRPO)",
    "chord_sft_per_device_train_batch_size": "CHORD (an SFT loss mixed into GRPO)",
    "chord_enable_phi_function": "CHORD (an SFT loss mixed into GRPO)",
    "chord_mu_warmup_steps": "CHORD (an SFT loss mixed into GRPO)",
    "chord_mu_decay_steps": "CHORD (an SFT loss mixed into GRPO)",
    "chord_mu_peak": "CHORD (an SFT loss mixed into GRPO)",
    "chord_mu_valley": "CHORD (an SFT loss mixed into GRPO)",
    "cached_dataset": "ms-swift's pre-tokenised datasets (give local JSONL with --dataset)",
    "cached_val_dataset": "ms-swift's pre-tokenised datasets (give local JSONL)",
    "custom_dataset_info": "ms-swift's dataset registry (give local JSONL with --dataset)",
    "custom_register_path": "ms-swift registration code (custom models, templates, datasets)",
    "callbacks": "ms-swift trainer callbacks (plugin code that may change training)",
    "adapters": "training on from an existing adapter (megagrpo starts LoRA at B = 0)",
    "mcore_adapter": "training on from an existing Megatron adapter",
    "ref_adapters": "a reference model with its own adapters",
    "mcore_ref_model": "a reference model other than the base model",
    "mcore_ref_adapter": "a reference model with its own adapter",
    "resume_from_checkpoint": "resuming an ms-swift checkpoint (megagrpo resumes its own: "
    "train --resume)",
    "mcore_model": "a Megatron-format base model (megagrpo loads the HF directory: --model)",
    "megatron_extra_kwargs": "arbitrary Megatron config overrides",
    "vllm_quantization": "a quantised rollout engine (samples another policy than it trains)",
}
"""What ms-swift trains that megagrpo does not (flag -> why): blocking whenever given."""

DEFAULT_ONLY: dict[str, tuple[Any, str]] = {
    "top_entropy_quantile": (1.0, "entropy-masked tokens"),
    "_teacher_use_disable_adapter": (False, "distillation from the base model (adapter off)"),
    "sync_ref_model": (False, "a reference model that follows the policy"),
    "use_gym_env": (None, "gym environments"),
    "freeze_vit": (True, "vision towers (megagrpo trains text-only models)"),
    # tuners and their options (LoRA as megagrpo trains it: plain, B = 0, no bias)
    "use_dora": (False, "DoRA"),
    "lora_bias": ("none", "LoRA biases"),
    "lora_dtype": (None, "LoRA weights in another dtype (megagrpo keeps them in fp32)"),
    "lorap_lr_ratio": (None, "LoRA+ (another learning rate for B)"),
    "init_weights": ("true", "another LoRA initialisation (megagrpo: Kaiming A, B = 0)"),
    "modules_to_save": ([], "fully trained modules beside LoRA"),
    "trainable_parameters": ([], "fully trained parameters beside LoRA"),
    "trainable_parameters_regex": (None, "fully trained parameters beside LoRA"),
    "freeze_parameters": ([], "full fine-tuning with frozen parts (LoRA only)"),
    "freeze_parameters_regex": (None, "full fine-tuning with frozen parts (LoRA only)"),
    "freeze_parameters_ratio": (0.0, "full fine-tuning with frozen parts (LoRA only)"),
    "freeze_llm": (False, "a frozen language model (multimodal training)"),
    "freeze_aligner": (True, "multimodal aligners (megagrpo trains text-only models)"),
    "use_galore": (False, "the GaLore optimizer"),
    "optim_target_modules": (None, "GaLore / APOLLO optimizer targets"),
    "lisa_activated_layers": (0, "LISA (layer-wise full training)"),
    "optimizer": (None, "an ms-swift optimizer plugin (megagrpo: AdamW)"),
    "optim": ("adamw_torch_fused", "another optimizer (megagrpo: AdamW)"),
    "optim_args": (None, "optimizer arguments"),
    "adam_epsilon": (1e-8, "another Adam epsilon (megagrpo: 1e-8)"),
    "adam_eps": (1e-8, "another Adam epsilon (megagrpo: 1e-8)"),
    "lr_scheduler_kwargs": (None, "LR scheduler arguments"),
    "lr_decay_iters": (None, "an LR schedule over another horizon than the run"),
    "lr_warmup_init": (0.0, "a warm-up that starts above 0"),
    "weight_decay_incr_style": ("constant", "a weight-decay schedule"),
    "start_weight_decay": (None, "a weight-decay schedule"),
    "end_weight_decay": (None, "a weight-decay schedule"),
    "main_grads_dtype": ("fp32", "gradients kept in another precision"),
    "main_params_dtype": ("fp32", "master weights in another precision"),
    "exp_avg_dtype": ("fp32", "Adam moments in another precision"),
    "exp_avg_sq_dtype": ("fp32", "Adam moments in another precision"),
    "fp8_format": (None, "FP8 training"),
    "fp4_format": (None, "FP4 training"),
    "apply_query_key_layer_scaling": (None, "query-key layer scaling"),
    "attention_softmax_in_fp32": (True, "attention softmax in low precision"),
    "moe_router_dtype": ("fp32", "router logits in another precision"),
    "router_aux_loss_coef": (0.0, "a router load-balancing loss"),
    "moe_aux_loss_coeff": (0.0, "a router load-balancing loss"),
    "moe_z_loss_coeff": (None, "a router z-loss"),
    "mtp_num_layers": (None, "multi-token-prediction layers"),
    "neftune_noise_alpha": (None, "NEFTune embedding noise"),
    "auto_find_batch_size": (False, "a batch size found at run time"),
    "task_type": ("causal_lm", "another task head (megagrpo trains causal LMs)"),
    "new_special_tokens": ([], "a vocabulary with new tokens"),
    "rope_scaling": (None, "RoPE scaling applied to the model"),
    "max_model_len": (None, "a changed model length (RoPE scaling)"),
    "model_kwargs": (None, "model construction arguments"),
    "agent_template": (None, "agent / tool prompts"),
    "use_chat_template": (None, "prompts without the chat template"),
    "response_prefix": (None, "a fixed prefix on every completion"),
    "stop_words": ([], "extra stop words for generation"),
    "structured_outputs_regex": (None, "regex-constrained generation"),
    "vllm_reasoning_parser": (None, "vLLM's reasoning parser on the completions"),
    "interleave_prob": (None, "datasets mixed by probability"),
    "stopping_strategy": ("first_exhausted", "datasets mixed until all are exhausted"),
    "sdar_loss_coef": (0.0, "the SDAR loss term"),
    "advantage_reweight": (None, "reweighted advantages (RLSD)"),
    "early_stop_interval": (None, "early stopping on an evaluation metric"),
    "enable_dft_loss": (False, "the DFT loss"),
    "moe_router_load_balancing_type": (None, "another router load-balancing method"),
}
"""Flags megagrpo trains at ms-swift's default only (flag -> (default, what another value
means)): harmless at the default, not supported otherwise."""

# ----------------------------------------------------------------------------- harmless

HARMLESS: dict[str, str] = _table(
    {
        "logging and run names (megagrpo logs metrics.jsonl, W&B under trainer.name)": """
        logging_first_step logging_strategy log_on_each_node logging_nan_inf_filter
        include_num_input_tokens_seen log_level log_level_replica disable_tqdm project
        trackio_space_id trackio_bucket_id trackio_static_space_id logging_dir
        tensorboard_dir tensorboard_queue_size skip_memory_metrics wandb_log_unique_prompts
        log_entropy log_rollout_offpolicy_metrics debug ray_exp_name acc_strategy
        swanlab_token swanlab_project swanlab_workspace swanlab_exp_name
        swanlab_notification_method swanlab_webhook_url swanlab_secret swanlab_sender_email
        swanlab_receiver_email swanlab_smtp_server swanlab_smtp_port swanlab_email_language
        swanlab_mode""",
        "hub and download (megagrpo reads local directories)": """use_hf hub_token
        model_revision ref_model_revision ref_model_type reward_model_revision
        teacher_model_revision push_to_hub hub_private_repo hub_model_id hub_strategy
        hub_always_push hub_revision download_mode local_repo_path""",
        "checkpoints, output and bookkeeping (megagrpo: runs/<trainer.name>, its own "
        "checkpoints)": """output_dir add_version create_checkpoint_symlink load_args
        load_data_args check_model ignore_args_error save_only_model save_strategy
        save_on_each_node enable_jit_checkpoint use_flash_ckpt safe_serialization
        max_shard_size load_best_model_at_end metric_for_best_model greater_is_better
        ignore_data_skip restore_callback_states_from_checkpoint resume_only_model no_save_optim
        no_save_rng no_load_optim no_load_rng finetune async_save use_persistent_ckpt_worker
        dist_ckpt_save_pre_mcore_014 dist_ckpt_optim_fully_reshardable
        distrib_optim_fully_reshardable_mem_efficient save_safetensors save_missing_weights
        merge_lora do_train do_eval do_predict local_rank""",
        "evaluation (megagrpo evaluates with trainer.eval_every / megagrpo eval)": """
        eval_strategy per_device_eval_batch_size eval_iters eval_delay prediction_loss_only
        eval_on_start eval_do_concat_batches eval_use_gather_object eval_accumulation_steps
        include_for_metrics batch_eval_metrics bf16_full_eval fp16_full_eval eval_metric
        eval_use_evalscope eval_dataset eval_dataset_args eval_limit eval_generation_config
        extra_eval_args val_dataset_shuffle num_generations_eval split_dataset_ratio""",
        "performance, memory and placement (where and how fast, not what is trained)": """
        offload_bridge optimizer_cpu_offload use_precision_aware_optimizer
        optimizer_offload_fraction optimizer_cuda_graph gradient_accumulation_fusion
        moe_shared_expert_overlap overlap_grad_reduce overlap_param_gather
        overlap_param_gather_with_optimizer_step align_grad_reduce align_param_gather
        overlap_p2p_comm batch_p2p_comm nccl_comm_warmup tp_comm_overlap
        use_distributed_optimizer use_megatron_fsdp strict_fsdp_dtensor_load
        data_parallel_sharding_strategy cross_entropy_loss_fusion cross_entropy_fusion_impl
        masked_softmax_fusion apply_rope_fusion bias_dropout_fusion bias_activation_fusion
        use_liger_kernel liger_kernel_config vllm_enforce_eager vllm_disable_cascade_attn
        torch_empty_cache_steps sequence_parallel_size context_parallel_size cp_comm_type
        cp_partition_mode sequence_packing_scheduler move_model_batches vllm_max_num_seqs
        vllm_engine_kwargs vllm_enable_prefix_caching vllm_pipeline_parallel_size
        vllm_data_parallel_size vllm_disable_custom_all_reduce vllm_use_async_engine
        vllm_speculative_config enable_flattened_weight_sync dataset_num_proc
        dataloader_num_workers dataloader_drop_last dataloader_persistent_workers
        dataloader_prefetch_factor dataloader_multiprocessing_context dataloader_pin_memory
        dataloader_in_order padding_free mlp_padding_free attention_backend attn_impl
        experts_impl moe_permute_fusion moe_grouped_gemm moe_token_dispatcher_type
        moe_enable_deepep moe_layer_recompute deepspeed deepspeed_autotp_size
        zero_hpz_partition_size fsdp fsdp_config gradient_checkpointing
        gradient_checkpointing_kwargs ds3_gather_for_generation use_logits_to_keep
        load_from_cache_file lazy_tokenize streaming shuffle_buffer_size packing
        packing_length packing_num_proc packing_strategy tf32 torch_compile
        torch_compile_backend torch_compile_mode use_cache full_determinism use_cpu
        accelerator_config parallelism_config ddp_find_unused_parameters ddp_bucket_cap_mb
        ddp_broadcast_buffers ddp_static_graph ddp_backend ddp_timeout manual_gc
        manual_gc_steps manual_gc_eval data_sharding te_rng_tracker perform_initialization
        use_cpu_initialization decoder_first_pipeline_num_layers
        decoder_last_pipeline_num_layers account_for_embedding_in_pipeline_split
        account_for_loss_in_pipeline_split virtual_pipeline_model_parallel_size
        microbatch_group_size_per_vp_stage pipeline_model_parallel_layout use_ray
        device_groups device_map max_memory tuner_backend use_swift_lora bridge_backend
        skip_megatron_init enable_npu_model_patch accumulate_allreduce_grads_in_fp32
        data_parallel_random_init padding_side template_backend init_strategy
        vit_gradient_checkpointing vit_gradient_checkpointing_kwargs vit_attn_impl
        remove_unused_columns strict disable_auto_column_mapping""",
    }
)
"""Flags that change where, how fast or with what bookkeeping ms-swift runs (flag -> why)."""

NO_EFFECT: dict[str, str] = _table(
    {
        "no effect on GRPO (another rlhf_type's flag)": """label_smoothing rpo_alpha ld_alpha
        discopop_tau loss_weights cpo_alpha simpo_gamma desirable_weight undesirable_weight
        center_rewards_coefficient sft_alpha lmbda seq_kd gkd_logits_topk reference_free
        f_divergence_type calculate_KL num_ppo_epochs
        whiten_rewards kl_coef cliprange vf_coef cliprange_value gamma lam num_mini_batches
        local_rollout_forward_batch_size num_sample_generations response_length
        missing_eos_penalty loss_scale calculate_per_token_loss label_names
        length_column_name group_by_length train_sampling_strategy sortish_sampler
        predict_with_generate generation_max_length generation_num_beams generation_config
        average_tokens_across_devices label_smoothing_factor enable_channel_loss mrl_dims
        is_binary_loss_scale disable_ignore_empty_think add_non_thinking_prefix
        preserve_thinking max_new_tokens num_beams stream logprobs top_logprobs
        decision_drop_instructions decision_subsample_options decision_state_as_text
        decision_shuffle_fields model_name model_author num_labels problem_type
        apply_wd_to_qk_layernorm""",
        "no effect on a text model (multimodal only)": """vit_lr aligner_lr norm_bbox
        vllm_limit_mm_per_prompt vllm_mm_processor_cache_gb language_model_only""",
        "no effect on Qwen3 / Qwen2 / Llama / Mistral (another architecture's option)": """
        engram_tokenizer_map dsa_indexer_loss_coeff dsa_indexer_use_sparse_loss
        apply_dsa_kernel_fusion csa_dense_mode use_fused_mhc mhc_recompute_layer_num
        linear_decoupled_in_proj""",
        "no effect without the option it refines (which is not supported, or not given)": """
        vllm_server_timeout vllm_server_group_port vllm_server_pass_dataset
        completion_length_limit_scope
        ref_model_sync_steps ref_model_mixup_alpha teacher_adapters teacher_model_type
        teacher_deepspeed offload_teacher_model teacher_tag_key teacher_kl_coef reward_adapters
        reward_model_type reward_template ref_model rlsd_lambda rlsd_reweight_clip_range
        rlsd_lambda_warmup_steps rlsd_lambda_decay_steps rlsd_negative_only sdar_gate_beta
        real_tau fipo_decay_rate fipo_clip_range fipo_clip_high_only fipo_safety_threshold
        hqq_axis bnb_4bit_compute_dtype bnb_4bit_use_double_quant bnb_4bit_quant_storage
        lora_ga_batch_size lora_ga_iters lora_ga_max_length lora_ga_direction lora_ga_scale
        lora_ga_stable_gamma galore_target_modules galore_rank galore_update_proj_gap
        galore_scale galore_proj_type galore_optim_per_parameter galore_with_embedding
        galore_quantization galore_proj_quant galore_proj_bits galore_proj_group_size
        galore_cos_threshold galore_gamma_proj galore_queue_size lisa_step_interval
        fourier_n_frequency fourier_scaling boft_block_size boft_block_num
        boft_n_butterfly_factor boft_dropout vera_rank vera_projection_prng_key vera_dropout
        vera_d_initial adapter_act adapter_length adalora_target_r adalora_init_r
        adalora_tinit adalora_tfinal adalora_deltaT adalora_beta1 adalora_beta2
        adalora_orth_reg_weight llamapro_num_new_blocks llamapro_num_groups reft_layer_key
        reft_layers reft_rank reft_intervention_type reft_args sgd_momentum muon_momentum
        muon_split_qkv muon_use_nesterov muon_scale_mode muon_fp32_matmul_prec
        muon_coefficient_type muon_num_ns_steps muon_tp_mode muon_extra_scale_factor
        muon_scalar_optimizer muon_lr muon_min_lr fp8_recipe fp8_param_gather
        fp8_amax_history_len fp8_amax_compute_algo fp4_recipe fp4_param_gather
        lr_wsd_decay_style lr_wsd_decay_iters moe_pad_expert_input_to_capacity
        moe_token_drop_policy mtp_loss_scaling_factor mtp_decoder_input_detach
        mtp_shared_weights""",
    }
)
"""ms-swift 4.6 flags with no effect on a GRPO run of a text model (flag -> why): harmless
(``ref_model``: with LoRA and no ``--ref_model`` the reference is the base model; a given
one is refused by :data:`REFINES`)."""

REFINES: dict[str, str] = {"ref_model": "a reference model other than the base model"}
"""Flags of :data:`NO_EFFECT` that do change training when given a value: not supported."""

NOTES: dict[str, str] = {
    "offload_bridge": "performance knob: the HF<->Megatron bridge's buffers (megagrpo "
    "streams weights in buckets: trainer.sync_transport)",
    "optimizer_cpu_offload": "performance knob: Megatron's optimizer CPU offload (the LoRA "
    "optimizer state is small; trainer.offload_during_rollout moves it during generation)",
    "use_precision_aware_optimizer": "performance knob: Megatron's precision-aware optimizer "
    "(megagrpo keeps fp32 LoRA moments)",
    "cross_entropy_loss_fusion": "megagrpo fuses its own loss",
    "use_liger_kernel": "megagrpo fuses its own loss",
    "sequence_parallel_size": "Ulysses sequence parallelism of swift rlhf (megagrpo: "
    "parallel.sequence_parallel with TP)",
    "context_parallel_size": "megagrpo has no context parallelism (memory, not what is trained)",
    "swanlab_project": "megagrpo has no SwanLab backend (W&B and metrics.jsonl)",
    "dataloader_drop_last": "megagrpo's curriculum sampler always draws full batches",
    "attention_backend": "model.spec te/local",
    "moe_grouped_gemm": "model.moe_grouped_gemm (TE spec only)",
    "deepspeed": "Megatron parallelism instead (parallel.*)",
    "finetune": "always fine-tuning from model.hf_path",
    "no_save_optim": "megagrpo checkpoints hold the optimizer (needed for --resume)",
    "no_save_rng": "megagrpo checkpoints hold the RNG states (bit-exact --resume)",
    "merge_lora": "megagrpo export --merged",
    "save_safetensors": "the final adapter is PEFT safetensors",
    "save_strategy": "trainer.save_every",
    "eval_strategy": "trainer.eval_every",
    "output_dir": "trainer.output_dir / trainer.name (runs/<name>)",
    "add_version": "runs/<trainer.name>",
    "log_entropy": "entropy is always logged (loss/entropy)",
    "split_dataset_ratio": "megagrpo trains on every row of data.train (data.eval is separate)",
    "use_hf": "megagrpo reads local directories (download with either hub first)",
    "model_revision": "megagrpo reads local directories",
    "tensorboard_dir": "metrics.tensorboard writes under the run directory",
    "vllm_device": "ms-swift 3.x placement of vLLM (megagrpo: rollout.colocate)",
    "num_infer_workers": "ms-swift 3.x placement of vLLM (megagrpo: rollout.colocate)",
}
"""A flag's own note where it says more than its group's reason."""

# ----------------------------------------------------------------------------- ms-swift 3.x

RENAMED_3X: dict[str, str] = {
    "train_type": "tuner_type",
    "log_interval": "logging_steps",
    "num_workers": "dataloader_num_workers",
    "save": "output_dir",
    "save_interval": "save_steps",
    "eval_interval": "eval_steps",
    "gpu_memory_utilization": "vllm_gpu_memory_utilization",
    "tensor_parallel_size": "vllm_tensor_parallel_size",
    "data_parallel_size": "vllm_data_parallel_size",
    "use_async_engine": "vllm_use_async_engine",
    "limit_mm_per_prompt": "vllm_limit_mm_per_prompt",
    "ref_load": "mcore_ref_model",
    "ref_adapter_load": "mcore_ref_adapter",
    "adapter_load": "mcore_adapter",
    "load": "mcore_model",
    "extra_megatron_kwargs": "megatron_extra_kwargs",
    "eval_datasets": "eval_dataset",
    "eval_datasets_args": "eval_dataset_args",
    "acc_steps": "gradient_accumulation_steps",
    "microbatch_group_size_per_virtual_pipeline_stage": "microbatch_group_size_per_vp_stage",
    "num_layers_per_virtual_pipeline_stage": "virtual_pipeline_model_parallel_size",
    "no_data_sharding": "data_sharding",
    "no_gradient_accumulation_fusion": "gradient_accumulation_fusion",
    "no_masked_softmax_fusion": "masked_softmax_fusion",
    "no_bias_dropout_fusion": "bias_dropout_fusion",
    "no_bias_swiglu_fusion": "bias_activation_fusion",
    "no_rope_fusion": "apply_rope_fusion",
}
"""ms-swift 3.x names with a 4.6 equivalent (old -> new): translated as the new flag (the
report names both). ``megatron rlhf``'s 3.x ``--max_epochs`` is 4.6's ``--num_train_epochs``
(:func:`renamed`)."""

OLD_3X: dict[str, str] = _table(
    {
        "an ms-swift 3.x flag with no effect here (placement, logging, checkpoint format)": """
        load_safetensors vllm_device num_infer_workers gc_collect_after_offload packing_cache
        ckpt_format auto_detect_ckpt_format ckpt_assume_constant_structure
        ckpt_fully_parallel_load exit_on_missing_checkpoint save_retain_interval
        dataloader_type distributed_backend distributed_timeout_minutes logging_level
        log_memory_to_tensorboard log_params_norm log_throughput log_timers_to_tensorboard
        log_validation_ppl_to_tensorboard no_log_learning_rate_to_tensorboard
        tensorboard_log_interval wandb_save_dir manual_gc_interval
        no_create_attention_mask_in_dataloader no_initialization transformer_impl
        use_flash_attn deterministic_mode swanlab_lark_secret swanlab_lark_webhook_url
        ckpt_dir lora_modules galore_config metric metric_warmup_step fsdp_num channels
        multi_turn_func use_shared_expert_gate""",
    }
)
"""ms-swift 3.x flags that are harmless (flag -> why)."""

ARCHITECTURE_3X = frozenset(
    _names(
        """architectures llm_architectures initialize_embedding layer_types
        linear_conv_kernel_dim linear_key_head_dim linear_num_key_heads linear_num_value_heads
        linear_value_head_dim mrope_interleaved original_max_position_embeddings
        padded_vocab_size partial_rotary_factor activation_func_clamp_value add_qkv_bias
        attention_dropout disable_bias_linear ffn_hidden_size glu_linear_offset
        group_query_attention hidden_dropout hidden_size kv_channels kv_lora_rank
        max_position_embeddings moe_apply_probs_on_input moe_ffn_hidden_size moe_layer_freq
        moe_router_bias_update_rate moe_router_enable_expert_bias moe_router_group_topk
        moe_router_num_groups moe_router_pre_softmax moe_router_score_function moe_router_topk
        moe_router_topk_scaling_factor moe_shared_expert_intermediate_size mrope_section
        multi_latent_attention no_rope_freq norm_epsilon normalization num_attention_heads
        num_experts num_layers num_query_groups num_virtual_stages_per_pipeline_rank
        position_embedding_type q_lora_rank qk_head_dim qk_l2_norm qk_layernorm
        qk_pos_emb_head_dim quick_geglu rotary_base rotary_interleaved rotary_percent
        seq_length softmax_type swiglu untie_embeddings_and_output_weights
        window_attn_skip_freq window_size"""
    )
)
"""ms-swift 3.x Megatron flags that override the model's architecture: megagrpo builds it
from config.json only (not supported when given)."""

# ----------------------------------------------------------------------------- new flags

HARMLESS_CLASSES = {
    "SwanlabArguments": "SwanLab logging",
    "RayArguments": "Ray placement",
}
"""ms-swift argument classes whose every field is harmless (a new field there included)."""
HARMLESS_NAME = re.compile(
    r"^(swanlab_|wandb_|tensorboard_|trackio_|hub_|push_to_hub|logging_|save_)|_exp_name$"
)
"""Names of logging, run-name, hub and checkpoint flags (a new one of these is harmless)."""


def harmless_by_declaration(flag: str, declared_in: str | None) -> str | None:
    """Why a flag not in these tables is harmless, read off where the installed ms-swift
    declares it (its argument class) and its name; None when neither says so."""
    if declared_in in HARMLESS_CLASSES:
        return f"declared in ms-swift's {declared_in} ({HARMLESS_CLASSES[declared_in]})"
    if HARMLESS_NAME.search(flag):
        return "a logging, run-name, hub or checkpoint flag (by its name)"
    return None


def renamed(flag: str, flavor: str) -> str | None:
    """The ms-swift 4.6 name of a 3.x flag (None: not renamed)."""
    if flag == "max_epochs" and flavor == "megatron":
        return "num_train_epochs"
    return RENAMED_3X.get(flag)


def at_default(value: Any, default: Any) -> bool:
    """``value`` as the command line gives it equals ms-swift's default ``default``."""
    if isinstance(default, list):
        return value in ([], None, "") or value == default
    if default is None:
        return value is None or str(value).lower() in ("none", "null", "")
    if isinstance(default, bool):
        return str(value).lower() in (("true", "1", "yes") if default else ("false", "0", "no"))
    if isinstance(default, int | float) and not isinstance(value, bool):
        try:
            return float(value) == float(default)
        except (TypeError, ValueError):
            return False
    return str(value).lower() == str(default).lower()


def known_flags() -> frozenset[str]:
    """Every flag these tables give a status."""
    return frozenset(
        MAPPED
        | UNSUPPORTED.keys()
        | DEFAULT_ONLY.keys()
        | HARMLESS.keys()
        | NO_EFFECT.keys()
        | RENAMED_3X.keys()
        | OLD_3X.keys()
        | ARCHITECTURE_3X
        | {"max_epochs"}
    )
