"""``tracedump run``: dump any Python process and its children without a code change."""
