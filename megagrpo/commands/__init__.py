"""`megagrpo` subcommands: one module per command, each exposing ``DESCRIPTION``,
``add_arguments(parser)`` and ``run(args) -> int`` (the registry is :mod:`megagrpo.cli`).

Commands are the top of the house: they parse flags, load the run config
(:class:`megagrpo.trainer.config.RunConfig`) and call library code; nothing in the library
imports them.
"""
