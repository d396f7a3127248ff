"""Stage 5, reporting: the typed report and what prints it (the table, ``--json``, ``--plot``,
``--html``). Decides nothing.
"""
