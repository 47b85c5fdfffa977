"""megagrpo.trainer: the GRPO loop and what it is built from.

=================  =======================================================================
``loop.py``        the step (``grpo_step``: every phase one call) and the rounds of
                   bounded dynamic sampling (``collect_batch``); ``train``
``setup.py``       ``build_context``: parallel state, policy + optimiser, rollouts,
                   rewards, samplers, loggers, resume; ``finish`` / ``shutdown``
``context.py``     ``TrainContext`` (the run's typed components) and ``Comm`` (the world)
``rollouts.py``    where generation runs: ``Rank0Rollouts`` | ``ShardedRollouts``
                   (generate + score a round, evaluate, push weights to every engine)
``optimize.py``    phase 5: micro-batched forward/backward with the fused loss, grad norm,
                   optimiser step
``batch.py``       groups -> padded micro-batches (targets, masks, advantages)
``sync.py``        phase 6: what the engines receive (merged tensors or the PEFT adapter)
                   and the trainer's probe that verifies it
``checkpoint.py``  the checkpoint format, and saving / restoring a ``TrainContext``
``config.py``      ``TrainerConfig`` and ``RunConfig`` (the root of every component config)
=================  =======================================================================
"""
