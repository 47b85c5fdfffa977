"""The ms-swift translator: an ms-swift GRPO launch (``swift rlhf`` / ``megatron rlhf`` command
line, YAML config or shell script) read and translated flag by flag into a megagrpo config,
with a status per flag and the ms-swift 4.6 knowledge it rests on in one place.

- :mod:`~megagrpo.swift.shell`: the shell reader (one command out of a script, variables,
  launchers) — never runs anything.
- :mod:`~megagrpo.swift.flags`: the flag tables and ms-swift's defaults per launcher; the
  statuses ``=`` (maps exactly), ``~`` (maps with another meaning or default), ``x`` (no
  equivalent).
- :mod:`~megagrpo.swift.flags_run` (data, rewards, optimiser), :mod:`~megagrpo.swift.batching`
  (batch sizes and launchers), :mod:`~megagrpo.swift.advantage` (advantage estimators),
  :mod:`~megagrpo.swift.fidelity` (the rules checked against ms-swift's own code).
- :mod:`~megagrpo.swift.translate`: reading the launch and running every rule.

``megagrpo from-swift`` (:mod:`megagrpo.commands.from_swift`) is the command's face: its
arguments, the report on stderr and the config it writes.
"""
