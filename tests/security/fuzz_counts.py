"""Cases each fuzz target ran in this session, and the seeds used (printed
in the terminal summary, for docs/reliability.md)."""

import collections

COUNTS: collections.Counter[str] = collections.Counter()
SEEDS: dict[str, int] = {}
