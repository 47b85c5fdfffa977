"""The checkpoint format, apart from the loop that writes it: a step directory of tensor
shards plus ``trainer.json`` under a manifest with checksums, written atomically, verified and
resharded on load, listed complete or not (:mod:`~megagrpo.checkpoint.format`, what
``megagrpo export`` and ``eval --step`` read); the values of ``trainer.json`` checked field by
field before anything loads them (:mod:`~megagrpo.checkpoint.checks`,
:mod:`~megagrpo.checkpoint.values`); plain JSON state and RNG states with nothing to unpickle
(:mod:`~megagrpo.checkpoint.plain`). What a run saves and restores is the trainer's
(:mod:`megagrpo.trainer.train_state`)."""
