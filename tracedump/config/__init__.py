"""What a run is asked to do: the ``TRACEDUMP_DUMP_*`` settings, read once, from the environment,
an engine's config object and the defaults, in that order, and checked before anything is hooked.

Read by the dump side (:mod:`tracedump.dump`) and by the launcher; the comparator only shares the
range syntax (:mod:`tracedump.util.ranges`).
"""
