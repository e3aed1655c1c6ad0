"""A prefix cache of token ids with finite capacity, reporting hits as SGLang's RadixCache does.

Follows SGLang's `RadixCache` (page size 1) and how the scheduler uses it:
- `Req.init_next_round_input` matches at most `len(input) - 1` tokens (the last input token is
  always computed): that match is `meta_info.cached_tokens`;
- `cache_finished_req` inserts `(input + output)[:-1]` (the last output token has no KV yet);
- when full, `evict` frees least-recently-used leaves first; `flush_cache` (and a weight update,
  which flushes by default) empties it.
A trie of dict nodes, one token per node: the capacity is counted in tokens (nodes).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence


class _Node:
    __slots__ = ("children", "last_used", "parent", "token")

    def __init__(self, parent: _Node | None, token: int, last_used: int):
        self.parent = parent
        self.token = token
        self.children: dict[int, _Node] = {}
        self.last_used = last_used


class RadixCache:
    def __init__(self, capacity_tokens: int):
        if capacity_tokens < 0:
            raise ValueError("capacity_tokens must be >= 0")
        self.capacity = capacity_tokens
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        self._root = _Node(None, -1, 0)
        self._leaf_nodes: set[_Node] = set()  # kept as the trie changes: eviction never walks it all
        self.size = 0

    def match_prefix(self, ids: Sequence[int]) -> int:
        """Length of the longest cached prefix of `ids` (touching it, for LRU)."""
        node, length, now = self._root, 0, next(self._clock)
        for token in ids:
            child = node.children.get(token)
            if child is None:
                break
            child.last_used = now
            node, length = child, length + 1
        return length

    def cached_tokens(self, input_ids: Sequence[int]) -> int:
        """What SGLang reports for a new request: the match over all but the last input token."""
        return self.match_prefix(input_ids[:-1])

    def insert(self, ids: Sequence[int]) -> None:
        """Cache `ids` (a finished request's `(input + output)[:-1]`), evicting LRU leaves to fit."""
        if self.capacity == 0:
            return
        ids = ids[: self.capacity]
        node, now = self._root, next(self._clock)
        path: list[_Node] = []
        for token in ids:
            child = node.children.get(token)
            if child is None:
                child = _Node(node, token, now)
                node.children[token] = child
                self._leaf_nodes.discard(node)
                self._leaf_nodes.add(child)
                self.size += 1
            child.last_used = now
            path.append(child)
            node = child
        if self.size > self.capacity:
            self._evict(self.size - self.capacity, protected=set(map(id, path)))

    def _evict(self, count: int, protected: set[int]) -> None:
        leaves = [(n.last_used, id(n), n) for n in self._leaf_nodes if id(n) not in protected]
        heapq.heapify(leaves)
        while count > 0 and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.token]
            self._leaf_nodes.discard(leaf)
            self.size -= 1
            count -= 1
            if parent is not self._root and not parent.children:
                self._leaf_nodes.add(parent)
                if id(parent) not in protected:
                    heapq.heappush(leaves, (parent.last_used, id(parent), parent))
