"""A character prefix tree with tenants, the data structure of Ray Serve LLM's and SGLang's
text-level routers (used only by the `ray_prefix` comparison policy).

Edges hold strings (radix tree), so memory grows with distinct text, not with requests."""

from __future__ import annotations


class _Node:
    __slots__ = ("children", "tenants")

    def __init__(self) -> None:
        self.children: dict[str, tuple[str, _Node]] = {}
        self.tenants: set[str] = set()


class TextPrefixTree:
    def __init__(self) -> None:
        self.root = _Node()

    def insert(self, text: str, tenant: str) -> None:
        node, i = self.root, 0
        node.tenants.add(tenant)
        while i < len(text):
            edge = node.children.get(text[i])
            if edge is None:
                leaf = _Node()
                leaf.tenants.add(tenant)
                node.children[text[i]] = (text[i:], leaf)
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
            node, i = child, i + j

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
