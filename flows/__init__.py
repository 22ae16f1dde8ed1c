"""Prefect flows for Atlas. Thin: they map shard tasks; the stage logic lives in ``atlas``."""
