"""`PrefixCache`: a radix trie of prompts holding next-token results and KV slots.

Layout. Each edge holds a run of tokens; the node below it may hold the log-probabilities that
follow the whole prefix (``logprobs``) and the `KvPool` slots of *that edge's positions only*
(``kv``, an int64 array, one slot per token). A prompt's past is the concatenation of the slots
along its path, so a trie storing T distinct prefix tokens holds T slots: siblings share their
parents' slots by reference, and splitting an edge splits its slot array (no KV is copied).
The forward gathers a batch's pasts from the pool by these slots in one operation.

Bounds. The pool's capacity caps the KV positions held (``max_kv_tokens``); ``cache_size``
caps the stored results, counted in vectors of memory held: a result is a row of its forward's
output, so one kept row holds its whole batch's buffer, and the bound counts buffers, not
rows. Both are evicted least-recently-used. KV-holding nodes stay closed under ancestors (a
path's past is usable up to its first node without KV), so KV eviction takes the least recent
node with no KV-holding child. Touching a path marks it from the leaf up, which keeps every
ancestor more recent than its descendants and makes the least recent node such a leaf at once.
Nodes left with no data are pruned, and a data-less node with one child is merged into it, so
the number of nodes stays bounded by the data held.

Slots for a forward's new positions are reserved before it runs (`reserve`, evicting what it
must, never the pasts of the batch being formed: `pin`), and given to the trie with the result
(`insert`), which frees those it does not keep (positions stored meanwhile by another row).

Adapters. A LoRA adapter changes results and KV alike, so each adapter has a trie of its own
(a root per adapter name, None for the base model) and nothing is ever shared across roots;
the bounds and the LRU orders are common to all, so the busiest adapters keep the most.

Every method runs on one thread (the event loop's); tensors handed out are never mutated.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .kv_pool import KvPool

__all__ = ["Past", "PrefixCache"]

_NO_SLOTS = np.zeros(0, dtype=np.int64)


class _Node:
    """One edge of the trie and the data known after its last token."""

    __slots__ = ("tokens", "parent", "children", "kv", "logprobs")

    def __init__(self, tokens: tuple[int, ...], parent: _Node | None) -> None:
        self.tokens = tokens
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.kv: np.ndarray | None = None
        self.logprobs: torch.Tensor | None = None

    def has_kv_child(self) -> bool:
        return any(child.kv is not None for child in self.children.values())


@dataclass(frozen=True, slots=True)
class Past:
    """The stored past of a prompt: its slots, in position order, and the node it ends at."""

    slots: np.ndarray
    node: _Node | None

    @property
    def length(self) -> int:
        return len(self.slots)


def _common_length(edge: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
    """How many leading tokens of `edge` equal ``tokens[start:]``.

    The whole edge matching is the common case (every lookup of a stored prompt), so it is
    one comparison of tuples in C before the token-by-token walk."""
    segment = tokens[start : start + len(edge)]
    if (segment if type(segment) is tuple else tuple(segment)) == edge:
        return len(edge)
    limit = min(len(edge), len(tokens) - start)
    k = 0
    while k < limit and edge[k] == tokens[start + k]:
        k += 1
    return k


class PrefixCache:
    """Results and KV slots of prompts, sharing storage along common prefixes.

    Args:
        cache_size: most log-probability vectors held (in memory held); 0 keeps none.
        pool: where KV lives; None keeps no KV.
    """

    def __init__(self, cache_size: int, pool: KvPool | None = None) -> None:
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        self.cache_size = cache_size
        self.pool = pool
        self._roots: dict[str | None, _Node] = {None: _Node((), None)}
        self._kv_lru: OrderedDict[_Node, None] = OrderedDict()
        self._result_lru: OrderedDict[_Node, None] = OrderedDict()
        self._kv_tokens = 0
        #: Output buffers the stored results are rows of: storage pointer -> [rows kept, bytes].
        self._buffers: dict[int, list[int]] = {}
        self._buffer_bytes = 0
        self._vector_bytes = 0

    @property
    def max_kv_tokens(self) -> int:
        """Most KV token positions held (the pool's capacity)."""
        return self.pool.capacity if self.pool is not None else 0

    @property
    def kv_tokens(self) -> int:
        """KV token positions held now."""
        return self._kv_tokens

    def kv_bytes(self) -> int:
        """Bytes of the KV held now."""
        return self._kv_tokens * self.pool.slot_bytes if self.pool is not None else 0

    @property
    def num_results(self) -> int:
        """Log-probability vectors held now."""
        return len(self._result_lru)

    @property
    def result_bytes(self) -> int:
        """Bytes of the output buffers that the held results keep alive."""
        return self._buffer_bytes

    def num_nodes(self) -> int:
        """Nodes in the trie, the root excluded."""
        stack, count = list(self._roots.values()), -len(self._roots)
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count

    # -- reading ---------------------------------------------------------------------------------
    def get(self, tokens: Sequence[int], adapter: str | None = None) -> torch.Tensor | None:
        """The stored log-probabilities after exactly `tokens` (under `adapter`), or None."""
        node = self._node_at(tokens, adapter)
        if node is None:
            return None
        if node.logprobs is not None:
            self._result_lru.move_to_end(node)
        return node.logprobs

    def has_result(self, tokens: Sequence[int], adapter: str | None = None) -> bool:
        """Whether `get` would find a result, without touching the trie's recency (a peek)."""
        node = self._node_at(tokens, adapter)
        return node is not None and node.logprobs is not None

    def _node_at(self, tokens: Sequence[int], adapter: str | None) -> _Node | None:
        """The node ending exactly at `tokens`, if the trie has one."""
        node, depth = self._roots.get(adapter), 0
        if node is None:
            return None
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None or _common_length(child.tokens, tokens, depth) < len(child.tokens):
                return None
            node, depth = child, depth + len(child.tokens)
        return node

    def past(self, tokens: Sequence[int], limit: int, adapter: str | None = None) -> Past:
        """The longest stored past of `tokens` (under `adapter`), at most `limit` long."""
        node, parts = self._past_walk(tokens, limit, adapter)
        if node is None:
            return Past(_NO_SLOTS, None)
        self._touch_kv_path(node)
        slots = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else _NO_SLOTS
        return Past(slots, node if parts else None)

    def stored_length(self, tokens: Sequence[int], limit: int, adapter: str | None = None) -> int:
        """How long `past` would be, without touching the trie's recency (a peek)."""
        return sum(len(part) for part in self._past_walk(tokens, limit, adapter)[1])

    def _past_walk(
        self, tokens: Sequence[int], limit: int, adapter: str | None
    ) -> tuple[_Node | None, list[np.ndarray]]:
        """The deepest node of the stored past of `tokens` (at most `limit` long; None: no
        trie for `adapter`) and the slots of its segments, root first (views, not copies)."""
        node, depth = self._roots.get(adapter), 0
        parts: list[np.ndarray] = []
        if node is None:
            return None, parts
        while depth < limit:
            child = node.children.get(tokens[depth])
            if child is None or child.kv is None:
                break
            k = min(_common_length(child.tokens, tokens, depth), limit - depth)
            parts.append(child.kv if k == len(child.tokens) else child.kv[:k])
            node, depth = child, depth + k
            if k < len(child.tokens):
                break
        return node, parts

    def kv_prefix(
        self, tokens: Sequence[int], limit: int, adapter: str | None = None
    ) -> tuple[np.ndarray, int]:
        """The slots of the longest stored past of `tokens`, and how many positions it covers."""
        past = self.past(tokens, limit, adapter)
        return past.slots, past.length

    # -- writing ---------------------------------------------------------------------------------
    def reserve(
        self, count: int, pinned: set[_Node] | frozenset[_Node] = frozenset()
    ) -> np.ndarray | None:
        """`count` pool slots for a forward's new positions, evicting least recent KV (never a
        node in `pinned`, nor so an ancestor of one) if needed; None if they cannot be had now.

        Slots freed while forwards run are quarantined (`KvPool`): eviction stops once the
        free and quarantined slots would cover the request, plus a sixteenth of the pool so
        that the next reservations find slots once the running forwards end.
        """
        pool = self.pool
        if pool is None or count > pool.capacity:
            return None
        slots = pool.allocate(count)
        if slots is not None:
            return slots
        headroom = count + pool.capacity // 16
        while pool.free_slots < count and pool.free_slots + pool.quarantined_slots < headroom:
            if not self._evict_kv(pinned):
                break
        return pool.allocate(count)

    def insert(
        self,
        tokens: Sequence[int],
        logprobs: torch.Tensor | None,
        kv_start: int = 0,
        slots: np.ndarray | None = None,
        adapter: str | None = None,
    ) -> None:
        """Store the result after `tokens` (under `adapter`), and the KV of its positions
        ``[kv_start, len)`` held in `slots`; slots not kept go back to the pool.

        Edges that already hold KV keep theirs; KV is stored only below ancestors that hold it,
        so a past evicted while `slots` were computed is simply not extended.
        """
        root = self._roots.get(adapter)
        if root is None:
            root = self._roots[adapter] = _Node((), None)
        kept = np.zeros(len(slots), dtype=bool) if slots is not None else None
        node, depth, parent_has_kv = root, 0, True
        while depth < len(tokens):
            child = self._child_along(node, tokens, depth)
            end = depth + len(child.tokens)
            if kept is not None and parent_has_kv and child.kv is None and depth >= kv_start:
                assert slots is not None
                self._set_kv(child, slots[depth - kv_start : end - kv_start])
                kept[depth - kv_start : end - kv_start] = True
            parent_has_kv = child.kv is not None
            node, depth = child, end
        if kept is not None and self.pool is not None and not kept.all():
            self.pool.free(slots[~kept])  # type: ignore[index]
        if logprobs is not None and self.cache_size:
            self._set_result(node, logprobs)
        self._touch_kv_path(node)
        self._prune(node)
        self._evict_results()

    def release(self, slots: np.ndarray | None) -> None:
        """Give back slots reserved for a forward whose results will not be stored."""
        if slots is not None and self.pool is not None:
            self.pool.free(slots)

    def clear(self) -> None:
        """Forget every result and every KV slot."""
        self.clear_kv()
        self._roots = {None: _Node((), None)}
        self._result_lru.clear()
        self._buffers.clear()
        self._buffer_bytes = 0

    def clear_kv(self) -> None:
        """Forget every KV slot, keeping the results."""
        held = list(self._kv_lru)
        for node in held:
            self._drop_kv(node)
        for node in reversed(held):
            self._prune(node)

    def drop_pool(self) -> None:
        """Keep no KV from now on (the model's KV does not fit the pool)."""
        self.clear_kv()
        self.pool = None

    def drop_adapter(self, adapter: str) -> None:
        """Forget every result and KV slot computed under `adapter` (unloaded or replaced)."""
        root = self._roots.pop(adapter, None)
        stack = list(root.children.values()) if root is not None else []
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.kv is not None:
                self._drop_kv(node)
            if node.logprobs is not None:
                self._drop_result(node)

    # -- internals -------------------------------------------------------------------------------
    def _child_along(self, node: _Node, tokens: Sequence[int], depth: int) -> _Node:
        """The child of `node` that `tokens` continues into, created or split to end on it."""
        child = node.children.get(tokens[depth])
        if child is None:
            child = _Node(tuple(tokens[depth:]), node)
            node.children[tokens[depth]] = child
            return child
        k = _common_length(child.tokens, tokens, depth)
        return child if k == len(child.tokens) else self._split(child, k)

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut `node`'s edge after `k` tokens; return the new upper node."""
        parent = node.parent
        assert parent is not None
        upper = _Node(node.tokens[:k], parent)
        parent.children[upper.tokens[0]] = upper
        node.tokens, node.parent = node.tokens[k:], upper
        upper.children[node.tokens[0]] = node
        if node.kv is not None:
            upper.kv, node.kv = node.kv[:k], node.kv[k:]
            self._kv_lru[upper] = None  # the caller touches the path through `upper` next
        return upper

    def _set_kv(self, node: _Node, slots: np.ndarray) -> None:
        node.kv = slots
        self._kv_tokens += len(slots)
        self._kv_lru[node] = None

    def _drop_kv(self, node: _Node) -> None:
        assert node.kv is not None and self.pool is not None
        self.pool.free(node.kv)
        self._kv_tokens -= len(node.kv)
        node.kv = None
        del self._kv_lru[node]

    def _set_result(self, node: _Node, logprobs: torch.Tensor) -> None:
        if node.logprobs is not None:
            self._drop_result(node)
        node.logprobs = logprobs
        self._result_lru[node] = None
        storage = logprobs.untyped_storage()
        held = self._buffers.get(storage.data_ptr())
        if held is None:
            self._buffers[storage.data_ptr()] = [1, storage.nbytes()]
            self._buffer_bytes += storage.nbytes()
        else:
            held[0] += 1
        self._vector_bytes = max(self._vector_bytes, logprobs.nbytes)

    def _drop_result(self, node: _Node) -> None:
        assert node.logprobs is not None
        pointer = node.logprobs.untyped_storage().data_ptr()
        held = self._buffers[pointer]
        held[0] -= 1
        if not held[0]:
            self._buffer_bytes -= held[1]
            del self._buffers[pointer]
        node.logprobs = None
        self._result_lru.pop(node, None)

    def _touch_kv_path(self, node: _Node | None) -> None:
        """Mark the KV of `node` and its ancestors used, leaf first so ancestors end most recent."""
        while node is not None:
            if node.kv is not None:
                self._kv_lru.move_to_end(node)
            node = node.parent

    def _evict_results(self) -> None:
        budget = self.cache_size * self._vector_bytes
        while self._result_lru and (
            len(self._result_lru) > self.cache_size or self._buffer_bytes > budget
        ):
            node = next(iter(self._result_lru))
            self._drop_result(node)
            self._prune(node)

    def _evict_kv(self, pinned: set[_Node] | frozenset[_Node]) -> bool:
        """Evict the least recent KV node that has no KV child and is not pinned; False if none.

        By the recency order the first unpinned node qualifies; the scan guards the invariant.
        """
        node = next((n for n in self._kv_lru if n not in pinned and not n.has_kv_child()), None)
        if node is None:
            return False
        self._drop_kv(node)
        self._prune(node)
        return True

    def _prune(self, node: _Node) -> None:
        """Drop data-less leaves upward from `node`; merge a data-less node into its only child."""
        while node.parent is not None and node.kv is None and node.logprobs is None:
            parent = node.parent
            if not node.children:
                del parent.children[node.tokens[0]]
                node = parent
                continue
            if len(node.children) == 1:
                (child,) = node.children.values()
                if child.kv is None:
                    child.tokens, child.parent = node.tokens + child.tokens, parent
                    parent.children[child.tokens[0]] = child
            return

    def _check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping disagrees with the trie (for tests)."""
        kv_tokens, kv_nodes, result_nodes = 0, set(), set()
        slots: list[np.ndarray] = []
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            assert node.parent is not None and node.parent.children[node.tokens[0]] is node
            if node.kv is not None:
                assert len(node.kv) == len(node.tokens)
                assert node.parent.parent is None or node.parent.kv is not None
                kv_tokens += len(node.tokens)
                kv_nodes.add(node)
                slots.append(node.kv)
            if node.logprobs is not None:
                result_nodes.add(node)
            assert node.kv is not None or node.logprobs is not None or len(node.children) > 1
            stack.extend(node.children.values())
        assert kv_tokens == self._kv_tokens <= self.max_kv_tokens
        held = np.concatenate(slots) if slots else _NO_SLOTS
        assert len(np.unique(held)) == len(held), "a slot is held by two nodes"
        assert kv_nodes == set(self._kv_lru) and result_nodes == set(self._result_lru)
        assert len(result_nodes) <= self.cache_size
