"""LLM engines: one small interface, three interchangeable engines (offline, openai, vllm)."""

from atlas.llm.engine import LLMEngine, LLMRequest, LLMResult, make_engine

__all__ = ["LLMEngine", "LLMRequest", "LLMResult", "make_engine"]
