"""Token-character tries: the mass of a next-token distribution under every byte prefix.

TokenCharacterTrie            the trie, its numbering, and masses one row at a time
└── ParallelTokenCharacterTrie    the same masses for a whole batch (numpy CPU or CUDA)
AsyncTokenCharacterTrie       concurrent requests batched over either
"""

from .async_trie import AsyncTokenCharacterTrie
from .parallel import ParallelTokenCharacterTrie
from .structure import LeafEdge, TokenCharacterTrie

__all__ = [
    "AsyncTokenCharacterTrie",
    "LeafEdge",
    "ParallelTokenCharacterTrie",
    "TokenCharacterTrie",
]
