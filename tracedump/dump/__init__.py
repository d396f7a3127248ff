"""The dump side: everything that runs inside the host process.

``attach()`` (:mod:`.dumper`) reads the settings, picks the modules (:mod:`.selection`), puts the
hooks on them (:mod:`.hooks`); each hook call goes to the recorder (:mod:`.recorder`), which gates
it (:mod:`.gates`), reduces or copies it (:mod:`.reduce`, :mod:`.cuda`) and hands it to a sink
(:mod:`.sinks`), whose writer thread (:mod:`.writer`) writes the pass files into the run directory
(:mod:`.rundir`). Data flows one way: host -> here -> :mod:`tracedump.store` (files).
"""
