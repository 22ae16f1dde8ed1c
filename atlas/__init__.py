"""Atlas: from a text corpus to a concept library, concept-annotated training shards and a concept-bottleneck LM."""

import os

# OpenMP threads that wait by spinning (the default of torch's runtime) hold a core while another process or worker
# needs it: on a busy 2-core machine, MiniLM encoded 38 phrases/s with 2 spinning threads, 275/s with passive ones.
# Set before torch loads; a value in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

_API = ("Run", "load_config", "run")  # atlas.api's main names, also reachable as atlas.run, atlas.Run, ...


def __getattr__(name: str):
    """Import atlas.api on first use of one of its names: ``import atlas`` itself stays instant."""
    if name in _API:
        from atlas import api

        return getattr(api, name)
    raise AttributeError(f"module 'atlas' has no attribute {name!r}")
