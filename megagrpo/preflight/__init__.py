"""``megagrpo preflight``: the run's exact config on its model truncated to a few layers with
dummy weights, every phase of start-up and of a step, before the real job
(:mod:`megagrpo.preflight.phases`; the command's face, model copy and report are
:mod:`megagrpo.commands.preflight`)."""
