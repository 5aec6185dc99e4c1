"""The model-side library both sides build on: what a language model *is* to lmqueue.

`AsyncLM` is the interface every backend implements and `QueueLM` implements too; `Token`,
`decode_vocab` and `check_prompt` say what a vocabulary and a valid prompt are; `OutputCache`
bounds cached vectors; the token-character tries turn next-token distributions into masses
under byte prefixes (`TokenCharacterTrie` one row at a time, `ParallelTokenCharacterTrie` in
bulk on CPU or CUDA, `AsyncTokenCharacterTrie` batching concurrent callers).

Nothing here knows about Redis: the wire agreement (messages, keys, errors, registry,
settings, connections) is the rest of `shared`.
"""

from .interface import AsyncLM
from .output_cache import OutputCache
from .tokens import Token
from .trie import AsyncTokenCharacterTrie, ParallelTokenCharacterTrie, TokenCharacterTrie
from .validation import check_loaded_adapter, check_prompt
from .vocab import decode_vocab

__all__ = [
    "AsyncLM",
    "AsyncTokenCharacterTrie",
    "OutputCache",
    "ParallelTokenCharacterTrie",
    "Token",
    "TokenCharacterTrie",
    "check_prompt",
    "decode_vocab",
    "check_loaded_adapter",
]
