"""The dump side: everything that runs inside the host process.

``attach()`` (:mod:`.dumper`) reads the settings, picks the modules (:mod:`.selection`), puts the
hooks on them (:mod:`.hooks`); each hook call goes to the recorder (:mod:`.recorder`, on the pass
state machine of :mod:`.passes`), which gates it (:mod:`.gates`, :mod:`.suspend`), reduces or
copies it (:mod:`tracedump.store.reduce`, :mod:`.cuda`) and hands it to a sink (:mod:`.sinks`), whose writer
thread (:mod:`.writer`) writes the pass files into the run directory (:mod:`.rundir`).
``capture()`` (:mod:`.capture`) and ``graft()`` (:mod:`.graft`) reuse the same parts. Data flows
one way: host -> here -> :mod:`tracedump.store` (files); nothing here imports the comparator.
"""
