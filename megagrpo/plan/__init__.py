"""Before you rent a GPU: predictors of a run that run nothing on a GPU.

- :mod:`megagrpo.plan.memory`, :mod:`~megagrpo.plan.time`, :mod:`~megagrpo.plan.search` and
  :mod:`~megagrpo.plan.scenario`: per-GPU memory of every phase and a step-time estimate of a
  run config's layout (``megagrpo plan-memory``), and the layout search.
- :mod:`megagrpo.plan.simulate` and :mod:`~megagrpo.plan.simulate_budget`: the real curriculum
  and dynamic sampler against a simulated rollout engine (``megagrpo plan``), with rollout
  budgets.
"""
