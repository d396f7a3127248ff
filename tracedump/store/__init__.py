"""The contract both halves share: what a dump is on disk, and how it is read back.

:mod:`.format` names every key and field, :mod:`.stformat` is the safetensors layout of a pass file,
:mod:`.fsio` the one atomic writer, :mod:`.loader` the reader (also the public ``open_dump``), and
:mod:`.sequences` which rows of which pass belong to which sequence. Nothing here imports the dump
side or the comparator.
"""
