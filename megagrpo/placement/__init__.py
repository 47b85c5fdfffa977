"""Where and how generation runs: the rollout corridor.

The trainer asks for a round; placement runs it on engines; scored groups come back. One
object (:class:`megagrpo.placement.rollouts.Rollouts`) stands between the GRPO loop and the
engines, whatever the layout::

    trainer/loop.py ──problems, n, seed──▶ Rollouts.generate_round ──▶ engines
          ▲                                                              │
          └──────── scored Groups (same on every rank) ◀─────────────────┘
    trainer/sync.py ──WeightUpdate (merged tensors or PEFT adapter)──▶ Rollouts.push (verified)

- :mod:`~megagrpo.placement.rollouts`: ``rollout.placement: rank0`` (one engine on rank 0)
  and ``sharded`` (engine replicas over the training ranks, colocated): generate + score a
  round, evaluate, push weights to every engine and verify them.
- :mod:`~megagrpo.placement.separate`: ``separate`` (engines on their own ranks, one step
  ahead of training), the trainer's side; :mod:`~megagrpo.placement.engine_rank` the engine
  ranks' loop; :mod:`~megagrpo.placement.bridge` the wire between them;
  :mod:`~megagrpo.placement.feed` the adapter from the trainer ranks that own it to every
  engine rank.
- :mod:`~megagrpo.placement.partial`: partial rollouts (completions carried across steps);
  :mod:`~megagrpo.placement.rounds` one partial round chunk by chunk, wherever it runs;
  :mod:`~megagrpo.placement.staleness` the policy versions, lag bounds and overlap.

Placement imports no trainer module: the loop's own sequencing of placement ``separate``
(start the next step's first round while this one trains) is :mod:`megagrpo.trainer.ahead`.
"""
