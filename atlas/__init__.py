"""Atlas: from a text corpus to a concept library, concept-annotated training shards and a concept-bottleneck LM."""

__version__ = "0.1.0"
