"""Expert client layer for the expert_edits feedback mode: an OpenAI-compatible chat client with
retries and concurrency, a disk cache of replies, and a tolerant parser of JSON edits."""
from .cache import ExpertCache, open_cache
from .errors import ExpertError
from .openai_backend import OpenAIExpert
from .parse import parse_edits

__all__ = ["ExpertCache", "ExpertError", "OpenAIExpert", "open_cache", "parse_edits"]
