"""Engines on their own ranks (``rollout.placement: separate``), and the rounds of partial
rollouts wherever they run.

- :mod:`megagrpo.placement.bridge`: the wire between trainer and engine ranks (channels, named
  tensor buckets that stay on the compute device).
- :mod:`megagrpo.placement.engine_rank`: an engine rank's loop (generate, partial rounds,
  verified pushes), one replica of ``rollout.tensor_parallel_size`` ranks in lock-step.
- :mod:`megagrpo.placement.rounds`: one partial-rollout round, chunk by chunk.
- :mod:`megagrpo.placement.feed`: the adapter from the trainer ranks that own it to every
  engine rank.

The trainer's side (:class:`megagrpo.trainer.separate.SeparateRollouts`) builds on these.
"""
