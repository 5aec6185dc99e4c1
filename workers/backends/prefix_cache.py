"""`PrefixCache`: a radix trie of prompts holding next-token results and KV segments.

Layout. Each edge holds a run of tokens; the node below it may hold the log-probabilities that
follow the whole prefix (``logprobs``) and the KV of *that edge's positions only* (``kv``, one
tensor shaped ``(layers, 2, kv_heads, edge_tokens, head_dim)``). A prompt's past is the
concatenation of the segments along its path, so a trie storing T distinct prefix tokens holds
T tokens of KV: O(n) memory. Storing each node's full past instead would be O(n^2) along a
path (a 24-step particle from a 200-token prompt would hold ~5,000 token-KVs instead of 224),
and the batched forward copies every row's past into one padded tensor anyway, so
concatenating segments there costs no extra copy; keeping all layers in one tensor keeps it at
one copy per segment rather than one per layer.

Bounds. ``max_kv_tokens`` caps the KV tokens held; ``cache_size`` caps the stored results.
Both are evicted least-recently-used. KV-holding nodes stay closed under ancestors (a path's
past is usable up to its first node without KV), so KV eviction takes the least recent node
with no KV-holding child. Touching a path marks it from the leaf up, which keeps every
ancestor more recent than its descendants and makes the least recent node such a leaf at once.
Nodes left with no data are pruned, and a data-less node with one child is merged into it, so
the number of nodes stays bounded by the data held.

Adapters. A LoRA adapter changes results and KV alike, so each adapter has a trie of its own
(a root per adapter name, None for the base model) and nothing is ever shared across roots;
the bounds and the LRU orders are common to all, so the busiest adapters keep the most.

Every method runs on one thread (the event loop's); tensors handed out are never mutated.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

__all__ = ["PrefixCache"]

#: Axis of the token positions in a KV segment ``(layers, 2, kv_heads, tokens, head_dim)``.
TOKEN_AXIS = 3


class _Node:
    """One edge of the trie and the data known after its last token."""

    __slots__ = ("tokens", "parent", "children", "kv", "logprobs")

    def __init__(self, tokens: tuple[int, ...], parent: _Node | None) -> None:
        self.tokens = tokens
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.kv: torch.Tensor | None = None
        self.logprobs: torch.Tensor | None = None

    def has_kv_child(self) -> bool:
        return any(child.kv is not None for child in self.children.values())


def _common_length(edge: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
    """How many leading tokens of `edge` equal ``tokens[start:]``."""
    limit = min(len(edge), len(tokens) - start)
    k = 0
    while k < limit and edge[k] == tokens[start + k]:
        k += 1
    return k


def _positions(kv: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Positions ``[start, stop)`` of a segment, as a tensor of its own (views would pin all)."""
    if start == 0 and stop == kv.shape[TOKEN_AXIS]:
        return kv
    return kv.narrow(TOKEN_AXIS, start, stop - start).clone()


class PrefixCache:
    """Results and KV segments of prompts, sharing storage along common prefixes.

    Args:
        max_kv_tokens: most KV token positions held over all segments; 0 keeps no KV.
        cache_size: most log-probability vectors held; 0 keeps none.
    """

    def __init__(self, max_kv_tokens: int, cache_size: int) -> None:
        if max_kv_tokens < 0 or cache_size < 0:
            raise ValueError(f"bounds must be >= 0, got {max_kv_tokens=} {cache_size=}")
        self.max_kv_tokens = max_kv_tokens
        self.cache_size = cache_size
        self._roots: dict[str | None, _Node] = {None: _Node((), None)}
        self._kv_lru: OrderedDict[_Node, None] = OrderedDict()
        self._result_lru: OrderedDict[_Node, None] = OrderedDict()
        self._kv_tokens = 0

    @property
    def kv_tokens(self) -> int:
        """KV token positions held now."""
        return self._kv_tokens

    def kv_bytes(self) -> int:
        """Bytes of the KV segments held now (one pass over the segments)."""
        return sum(node.kv.nbytes for node in self._kv_lru if node.kv is not None)

    @property
    def num_results(self) -> int:
        """Log-probability vectors held now."""
        return len(self._result_lru)

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
        node, depth = self._roots.get(adapter), 0
        if node is None:
            return None
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None or _common_length(child.tokens, tokens, depth) < len(child.tokens):
                return None
            node, depth = child, depth + len(child.tokens)
        if node.logprobs is not None:
            self._result_lru.move_to_end(node)
        return node.logprobs

    def kv_prefix(
        self, tokens: Sequence[int], limit: int, adapter: str | None = None
    ) -> tuple[list[torch.Tensor], int]:
        """The KV segments covering the longest stored past of `tokens` (under `adapter`), at
        most `limit` long.

        Returns:
            The segments in order, and the number of positions they cover.
        """
        node, depth = self._roots.get(adapter), 0
        segments: list[torch.Tensor] = []
        if node is None:
            return segments, 0
        while depth < limit:
            child = node.children.get(tokens[depth])
            if child is None or child.kv is None:
                break
            k = min(_common_length(child.tokens, tokens, depth), limit - depth)
            segments.append(child.kv if k == len(child.tokens) else child.kv[:, :, :, :k])
            node, depth = child, depth + k
            if k < len(child.tokens):
                break
        self._touch_kv_path(node)
        return segments, depth

    # -- writing ---------------------------------------------------------------------------------
    def insert(
        self,
        tokens: Sequence[int],
        logprobs: torch.Tensor | None,
        kv_start: int = 0,
        kv: torch.Tensor | None = None,
        adapter: str | None = None,
    ) -> None:
        """Store the result after `tokens` (under `adapter`), and `kv` for its positions
        ``[kv_start, len)``.

        Edges that already hold KV keep theirs; KV is stored only below ancestors that hold it,
        so a past evicted while `kv` was computed is simply not extended.
        """
        root = self._roots.get(adapter)
        if root is None:
            root = self._roots[adapter] = _Node((), None)
        node, depth, parent_has_kv = root, 0, True
        while depth < len(tokens):
            child = self._child_along(node, tokens, depth)
            end = depth + len(child.tokens)
            if kv is not None and parent_has_kv and child.kv is None and depth >= kv_start:
                self._set_kv(child, _positions(kv, depth - kv_start, end - kv_start))
            parent_has_kv = child.kv is not None
            node, depth = child, end
        if logprobs is not None and self.cache_size:
            node.logprobs = logprobs
            self._result_lru[node] = None
            self._result_lru.move_to_end(node)
        self._touch_kv_path(node)
        self._prune(node)
        self._evict()

    def clear(self) -> None:
        """Forget every result and every KV segment."""
        self._roots = {None: _Node((), None)}
        self._kv_lru.clear()
        self._result_lru.clear()
        self._kv_tokens = 0

    def clear_kv(self) -> None:
        """Forget every KV segment, keeping the results."""
        held = list(self._kv_lru)
        for node in held:
            node.kv = None
        self._kv_lru.clear()
        self._kv_tokens = 0
        for node in reversed(held):
            self._prune(node)

    def drop_adapter(self, adapter: str) -> None:
        """Forget every result and KV segment computed under `adapter` (unloaded or replaced)."""
        root = self._roots.pop(adapter, None)
        stack = list(root.children.values()) if root is not None else []
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.kv is not None:
                self._kv_tokens -= node.kv.shape[TOKEN_AXIS]
                del self._kv_lru[node]
            self._result_lru.pop(node, None)

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
            length = k + len(node.tokens)
            upper.kv, node.kv = _positions(node.kv, 0, k), _positions(node.kv, k, length)
            self._kv_lru[upper] = None  # the caller touches the path through `upper` next
        return upper

    def _set_kv(self, node: _Node, kv: torch.Tensor) -> None:
        node.kv = kv
        self._kv_tokens += kv.shape[TOKEN_AXIS]
        self._kv_lru[node] = None

    def _touch_kv_path(self, node: _Node | None) -> None:
        """Mark the KV of `node` and its ancestors used, leaf first so ancestors end most recent."""
        while node is not None:
            if node.kv is not None:
                self._kv_lru.move_to_end(node)
            node = node.parent

    def _evict(self) -> None:
        while len(self._result_lru) > self.cache_size:
            node, _ = self._result_lru.popitem(last=False)
            node.logprobs = None
            self._prune(node)
        while self._kv_tokens > self.max_kv_tokens:
            # By the recency order the first node qualifies; the scan guards the invariant.
            node = next(n for n in self._kv_lru if not n.has_kv_child())
            del self._kv_lru[node]
            assert node.kv is not None
            self._kv_tokens -= node.kv.shape[TOKEN_AXIS]
            node.kv = None
            self._prune(node)

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
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            assert node.parent is not None and node.parent.children[node.tokens[0]] is node
            if node.kv is not None:
                assert node.kv.shape[TOKEN_AXIS] == len(node.tokens)
                assert node.parent.parent is None or node.parent.kv is not None
                kv_tokens += len(node.tokens)
                kv_nodes.add(node)
            if node.logprobs is not None:
                result_nodes.add(node)
            assert node.kv is not None or node.logprobs is not None or len(node.children) > 1
            stack.extend(node.children.values())
        assert kv_tokens == self._kv_tokens <= self.max_kv_tokens
        assert kv_nodes == set(self._kv_lru) and result_nodes == set(self._result_lru)
        assert len(result_nodes) <= self.cache_size
