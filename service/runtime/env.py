"""One node's view of a run's named buffers: the DAG's declarations enforced at every access.

A node may read the buffers it declares as inputs or outputs (an output it updates in place, such
as a suffix slot, is both) and may write only its declared outputs; anything else raises
UndeclaredBuffer naming the node and the buffer. The declarations are then the whole data flow of
the DAG, which is what the C++ runtime relies on (cpp_dag checks the same declarations at load).
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping

import torch

from ..artifact.dag import Node


class UndeclaredBuffer(RuntimeError):
    """A node touched a buffer its DAG entry does not declare."""


class NodeEnv(MutableMapping[str, torch.Tensor]):
    __slots__ = ("_env", "_node", "_readable", "_writable")

    def __init__(self, env: dict[str, torch.Tensor], node: Node) -> None:
        self._env, self._node = env, node
        self._writable = frozenset(node.outputs)
        self._readable = frozenset(node.inputs) | self._writable

    def _refuse(self, action: str, name: str, declared_as: str) -> UndeclaredBuffer:
        return UndeclaredBuffer(f"node {self._node.name} ({self._node.type}) {action} buffer {name!r}, which it does "
                                f"not declare as {declared_as}")

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._readable:
            raise self._refuse("reads", name, "an input")
        return self._env[name]

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        if name not in self._writable:
            raise self._refuse("writes", name, "an output")
        self._env[name] = value

    def __delitem__(self, name: str) -> None:
        raise self._refuse("deletes", name, "something it may delete (no node may)")

    def __contains__(self, name: object) -> bool:
        if name not in self._readable:
            raise self._refuse("looks for", str(name), "an input")
        return name in self._env

    def __iter__(self) -> Iterator[str]:
        return (name for name in self._env if name in self._readable)

    def __len__(self) -> int:
        return sum(1 for _ in self)
