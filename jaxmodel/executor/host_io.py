"""One buffer each way between the host and a jitted step: its small arrays (tokens, positions, page tables,
drafts, sampling settings in; accepted counts, committed tokens, next drafts out) packed into one int32 array.

Every numpy argument of a jitted call is its own host-to-device transfer, and every result read back its own
synchronisation. A speculative step has about 26 small inputs and 9 small outputs, which on CPU cost about half of
a small model's one-token call; packed, they are one of each (docs/performance.md, "Iterations per device call
and the host round trip").

Leaves may be int32, uint32, float32 (bit-cast, so exact) or bool (stored as 0/1).

>>> import numpy as np
>>> buffer, layout = pack({"n": np.array([3, 4], np.int32), "p": np.float32(0.5), "ok": np.array([True, False])})
>>> buffer.dtype, buffer.shape, layout.size
(dtype('int32'), (5,), 5)
>>> tree = unpack_host(buffer, layout)  # pack_traced's buffer comes back the same way
>>> float(tree["p"]), tree["ok"].tolist(), tree["n"].tolist()
(0.5, [True, False], [3, 4])
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import executables

_BIT_CAST = frozenset({"float32", "uint32"})
_DTYPE_NAMES = {np.dtype(name): name for name in ("int32", "bool", *_BIT_CAST)}


@dataclass(frozen=True)
class Layout:
    """Where each leaf of a pytree lies in a packed buffer. Hashable: a jitted call takes it as a static argument, so
    each layout (each padded step shape) is its own compilation, as the unpacked arrays' shapes were."""

    treedef: Any  # jax.tree_util.PyTreeDef
    leaves: tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype name) per leaf, in treedef order

    @property
    def size(self) -> int:
        return sum(n for _, n, _, _ in _places(self))


@functools.lru_cache(maxsize=1024)
def _places(layout: Layout) -> tuple[tuple[int, int, tuple[int, ...], str], ...]:
    """(offset, size, shape, dtype name) of each leaf."""
    places, offset = [], 0
    for shape, dtype in layout.leaves:
        n = int(np.prod(shape, dtype=np.int64))
        places.append((offset, n, shape, dtype))
        offset += n
    return tuple(places)


def _leaf_dtype(dtype) -> str:
    name = _DTYPE_NAMES.get(np.dtype(dtype))
    if name is None:
        raise TypeError(f"a packed leaf must be int32, uint32, float32 or bool, not {np.dtype(dtype).name}")
    return name


def pack(tree) -> tuple[np.ndarray, Layout]:
    """A pytree of host arrays -> (buffer [size] int32, its layout). Host side."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [np.asarray(leaf) for leaf in leaves]
    layout = Layout(treedef, tuple((a.shape, _leaf_dtype(a.dtype)) for a in arrays))
    parts = [a.reshape(-1).view(np.int32) if a.dtype.itemsize == 4 else a.reshape(-1).astype(np.int32) for a in arrays]
    return (np.concatenate(parts) if parts else np.zeros((0,), np.int32)), layout


def unpack(buffer: jax.Array, layout: Layout):
    """The inverse of `pack` inside a jitted function: buffer [size] int32 -> the pytree, as jax arrays."""
    leaves = []
    for offset, n, shape, dtype in _places(layout):
        part = jax.lax.slice(buffer, (offset,), (offset + n,)).reshape(shape)
        if dtype == "bool":
            part = part != 0
        elif dtype in _BIT_CAST:
            part = jax.lax.bitcast_convert_type(part, jnp.dtype(dtype))
        leaves.append(part)
    return jax.tree.unflatten(layout.treedef, leaves)


def pack_traced(tree) -> tuple[jax.Array, Layout]:
    """A pytree of jax arrays -> (buffer [size] int32, its layout), inside a jitted function."""
    leaves, treedef = jax.tree.flatten(tree)
    layout = Layout(treedef, tuple((tuple(x.shape), _leaf_dtype(x.dtype)) for x in leaves))
    parts = []
    for x in leaves:
        if x.dtype == jnp.bool_:
            x = x.astype(jnp.int32)
        elif x.dtype != jnp.int32:
            x = jax.lax.bitcast_convert_type(x, jnp.int32)
        parts.append(x.reshape(-1))
    return (jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.int32)), layout


def unpack_host(buffer: np.ndarray, layout: Layout):
    """The inverse of `pack_traced` on the host: buffer [size] int32 -> the pytree, as numpy views of it."""
    leaves = []
    for offset, n, shape, dtype in _places(layout):
        part = buffer[offset : offset + n].reshape(shape)
        leaves.append(part != 0 if dtype == "bool" else part.view(dtype) if dtype in _BIT_CAST else part)
    return layout.treedef.unflatten(leaves)


def _static_key(static: dict) -> tuple:
    return tuple(sorted(static.items()))


class PackedCall:
    """`fn(weights, state=..., **inputs, **static) -> (outputs, state)` jitted so that its small host inputs travel
    as one packed buffer and its outputs come back as one, state donated.

    call(weights, state, inputs, **static) -> (outputs as numpy arrays, state): inputs is a dict of pytrees of host
    arrays (None for an absent one), static the jit-static keyword arguments. The outputs' layout is recorded when
    the call is traced, which happens before the first call of each layout and static arguments and again whenever
    jit's cache has let that executable go; `traced` says whether the calling thread's last call traced (and so
    also compiled, unless a cache held it) or loaded its executable, which makes its time no measure of a step.

    A named call whose caller passes `held` (a dict of its own, for one set of weights and state whose shapes and
    placement never change) takes its executables from the store `executables.keep_executables` keeps, when one is
    kept: loaded from disk, or compiled and saved there; `held` keeps them for that caller's later calls, and calls
    of other callers with the same key share them. `name` must say what `fn` is (its function and model config).
    """

    def __init__(self, fn, static_argnames: tuple[str, ...] = (), name: str | None = None):
        self.name = name
        self._out_layouts: dict[tuple, Layout] = {}
        self._shared: dict[str, jax.stages.Compiled] = {}  # by store key
        # Per thread: runtimes of one model share a call (`runtime._compiled`), and engines side by side call it
        # from threads of their own; one thread's trace says nothing of another's call.
        self._thread = threading.local()

        def packed(weights, state, buffer, *, layout: Layout, **static):
            self._thread.n_traces = self._n_traces + 1  # tracing runs in the calling thread
            out, state = fn(weights, state=state, **unpack(buffer, layout), **static)
            buffer, out_layout = pack_traced(out)
            self._out_layouts[layout, _static_key(static)] = out_layout
            return buffer, state

        self._packed, self._static_argnames = packed, ("layout", *static_argnames)
        self._jitted = jax.jit(packed, static_argnames=self._static_argnames, donate_argnames="state")

    def compile(self, weights, state, inputs: dict, held: dict | None = None, **static) -> None:
        """Trace and compile the call these arguments make (or load it, as `__call__` would), without running it
        (nothing is donated): a later call of the same layout and static arguments finds the executable where jit
        (or `held`) keeps it. Safe to run from several threads at once; XLA compiles without holding the GIL, so
        distinct shapes then compile side by side."""
        buffer, layout = pack(inputs)
        store = self._store(held)
        if store is not None:
            self._executable(store, held, weights, state, buffer, layout, static)
        else:
            self._jitted.lower(weights, state, buffer, layout=layout, **static).compile()

    def __call__(self, weights, state, inputs: dict, held: dict | None = None, **static):
        buffer, layout = pack(inputs)
        shape = layout, _static_key(static)
        n_traces = self._n_traces
        store = self._store(held)
        if store is not None:
            executable = held.get(shape)
            if executable is None:
                executable = self._executable(store, held, weights, state, buffer, layout, static)
            out, state = executable(weights, state, buffer)
        else:
            out, state = self._jitted(weights, state, buffer, layout=layout, **static)
        self._thread.traced = self._n_traces > n_traces
        return unpack_host(np.asarray(out), self._out_layouts[shape]), state

    def _named(self, name: str):
        """The call jitted as a function called `name` (jit reads the arguments' names, the donated state's among
        them, through `__wrapped__`)."""
        @functools.wraps(self._packed)
        def packed(*args, **kwargs):
            return self._packed(*args, **kwargs)

        packed.__name__ = packed.__qualname__ = name
        return jax.jit(packed, static_argnames=self._static_argnames, donate_argnames="state")

    def _store(self, held: dict | None):
        return executables.store() if held is not None and self.name is not None else None

    def _executable(self, store, held: dict, weights, state, buffer, layout: Layout, static: dict):
        """The executable of this shape for `held`'s caller: shared, loaded from the store, or compiled and
        saved there."""
        static_key = _static_key(static)
        key = store.key(self.name, (weights, state, buffer), (layout, static_key))
        executable = self._shared.get(key)
        if executable is None:
            found = store.load(key)
            if found is not None:
                executable, self._out_layouts[layout, static_key] = found
            else:  # lowering traces, which records the outputs' layout
                lowered = self._named(executables.module_name(key)).lower(weights, state, buffer, layout=layout,
                                                                          **static)
                executable = store.compile_and_save(key, lowered, self._out_layouts[layout, static_key])
            self._shared[key] = executable
        held[layout, static_key] = executable
        self._thread.n_traces = self._n_traces + 1  # this call's time includes finding its executable
        return executable

    @property
    def _n_traces(self) -> int:
        return getattr(self._thread, "n_traces", 0)

    @property
    def traced(self) -> bool:
        """Whether this thread's last call traced."""
        return getattr(self._thread, "traced", False)
