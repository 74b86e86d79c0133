"""tokenloom: an LLM inference engine with a paged KV cache and continuous batching."""

from tokenloom.errors import ContextTooLong, EngineDead, InvalidRequest, ModelLoadError, Overloaded, TokenloomError
from tokenloom.llm import LLM
from tokenloom.outputs import CompletionOutput, RequestOutput
from tokenloom.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "TokenloomError",
    "InvalidRequest",
    "ContextTooLong",
    "Overloaded",
    "EngineDead",
    "ModelLoadError",
]
__version__ = "0.1.0"
