"""Small helpers used by more than one half: the console, byte sizes, usable CPUs, and the one-pass
C sums (``kernel.c``) that both the stats dump and the comparator use."""
