"""A character prefix tree with tenants, the data structure of Ray Serve LLM's and SGLang's
text-level routers (used only by the `ray_prefix` comparison policy).

Edges hold strings (radix tree), so memory grows with distinct text, not with requests, and
it is bounded as Ray's tree is: past `max_chars` characters the least recently used leaves
go until `target_chars` remain."""

from __future__ import annotations

# Ray Serve LLM's PrefixCacheAffinityRouter defaults (eviction_threshold_chars,
# eviction_target_chars).
MAX_CHARS = 400_000
TARGET_CHARS = 360_000


class _Node:
    __slots__ = ("children", "tenants", "used")

    def __init__(self) -> None:
        self.children: dict[str, tuple[str, _Node]] = {}
        self.tenants: set[str] = set()
        self.used = 0
        """When the node was last on an inserted path (the tree's own counter)."""


class TextPrefixTree:
    def __init__(self, max_chars: int = MAX_CHARS, target_chars: int = TARGET_CHARS) -> None:
        self.root = _Node()
        self.max_chars, self.target_chars = max_chars, target_chars
        self.chars = 0
        """Characters on all edges: the tree's size."""
        self._tick = 0

    def insert(self, text: str, tenant: str) -> None:
        self._insert(text, tenant)
        if self.chars > self.max_chars:
            self._evict()

    def _insert(self, text: str, tenant: str) -> None:
        self._tick += 1
        node, i = self.root, 0
        node.tenants.add(tenant)
        while i < len(text):
            node.used = self._tick
            edge = node.children.get(text[i])
            if edge is None:
                leaf = _Node()
                leaf.tenants.add(tenant)
                leaf.used = self._tick
                node.children[text[i]] = (text[i:], leaf)
                self.chars += len(text) - i
                return
            label, child = edge
            j = 0
            while j < len(label) and i + j < len(text) and label[j] == text[i + j]:
                j += 1
            if j < len(label):  # split the edge
                mid = _Node()
                mid.tenants = set(child.tenants)
                mid.children[label[j]] = (label[j:], child)
                node.children[text[i]] = (label[:j], mid)
                child = mid
            child.tenants.add(tenant)
            child.used = self._tick
            node, i = child, i + j

    def _evict(self) -> None:
        """Drop least recently used leaves until `target_chars` remain; a parent left
        without children becomes a leaf, dropped in its turn if it is old enough."""
        while self.chars > self.target_chars:
            leaves: list[tuple[int, _Node, str, int]] = []
            stack = [self.root]
            while stack:
                n = stack.pop()
                for first, (label, child) in n.children.items():
                    if child.children:
                        stack.append(child)
                    else:
                        leaves.append((child.used, n, first, len(label)))
            if not leaves:
                return
            leaves.sort(key=lambda leaf: leaf[0])
            for _, parent, first, size in leaves:
                if self.chars <= self.target_chars:
                    break
                del parent.children[first]
                self.chars -= size

    def longest_match(self, text: str, tenants: set[str]) -> tuple[int, set[str]]:
        """Characters matched by the best tenants among `tenants`, and those tenants."""
        node, i = self.root, 0
        best: tuple[int, set[str]] = (0, set())
        while i < len(text):
            edge = node.children.get(text[i])
            if edge is None:
                break
            label, child = edge
            live = child.tenants & tenants
            if not live:
                break
            j = 0
            while j < len(label) and i + j < len(text) and label[j] == text[i + j]:
                j += 1
            best = (i + j, live)
            if j < len(label):
                break
            node, i = child, i + j
        return best

    def remove_tenant(self, tenant: str) -> None:
        stack = [self.root]
        while stack:
            n = stack.pop()
            n.tenants.discard(tenant)
            stack.extend(c for _, c in n.children.values())
