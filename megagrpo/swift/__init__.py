"""The ms-swift translator: an ms-swift GRPO launch (``swift rlhf`` / ``megatron rlhf`` command
line, YAML config or shell script) read and translated flag by flag into a megagrpo config,
with a status per flag and the ms-swift 4.6 knowledge it rests on in one place.

- :mod:`~megagrpo.swift.shell`: the shell reader (one command out of a script, variables,
  launchers) — never runs anything.
- :mod:`~megagrpo.swift.catalog`: what from-swift knows of ms-swift 4.6 in one place: its
  defaults per launcher and a status for every field of its GRPO argument classes;
  :mod:`~megagrpo.swift.source` reads the installed ms-swift's argument dataclasses without
  importing it; :mod:`~megagrpo.swift.status` gives the flags no rule takes their status.
- :mod:`~megagrpo.swift.flags`: the rules and statuses ``=`` (maps exactly), ``~`` (maps with
  another meaning or default), ``-`` (harmless), ``x`` (not supported: blocks), ``?`` (not
  known to from-swift: blocks unless --allow-unknown).
- :mod:`~megagrpo.swift.flags_run` (data, rewards, optimiser), :mod:`~megagrpo.swift.flags_extra`
  (adapter targets, template, data order, run name), :mod:`~megagrpo.swift.batching` (batch
  sizes and launchers), :mod:`~megagrpo.swift.steps` (optimizer steps per launcher),
  :mod:`~megagrpo.swift.advantage` (advantage estimators), :mod:`~megagrpo.swift.fidelity`
  (the rules checked against ms-swift's own code).
- :mod:`~megagrpo.swift.translate`: reading the launch and running every rule.

``megagrpo from-swift`` (:mod:`megagrpo.commands.from_swift`) is the command's face: its
arguments, the report on stderr and the config it writes.
"""
