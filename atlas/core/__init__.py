"""Stage machinery shared by every Atlas stage: run directory, atomic files, stats, the Stage contract."""
