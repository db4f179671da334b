"""Several processes, one mesh (`jax.distributed`; docs/design.md "Tensor parallelism"): process 0 runs the server,
the scheduler and the engine; the others (followers) hold their devices' shards of the same model and run, call
for call, the same jitted programs on them.

Every process builds the same engine from the same arguments, so each holds a `Runtime` of the target with the
same host state and its own shards of the weights and pools. Only process 0's engine schedules. Each call of its
runtime that runs the device or changes host state that device calls read (`MIRRORED`) is first sent, as the
method's name and arguments (the step's rows: tokens, positions, page tables, drafts), to every follower, which
runs the same method on its own runtime: every process then runs the same programs in the same order with the
same inputs, as SPMD over a mesh spanning processes requires, and only process 0 reads the results out. Before that,
with `--warmup-first`, every process warms up its own engine (each step shape run once, then the drafter policy's
calibration): identical engines make the same device calls in the same order, so the warm-up needs no messages.
Without it, steps compile on first use (a background warm-up, which interleaves with serving, is not offered).

The calls travel over one socket per follower (`multiprocessing.connection`, authenticated; its address and key
go through the coordination service's key-value store, which every process reaches already). The socket also
tells process 0 when a follower ends: a step that waits on that follower's collectives would wait forever, so a
watcher thread logs which follower ended and why, and ends process 0 (`FOLLOWER_GONE_EXIT`).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import sys
import threading
from multiprocessing.connection import Client, Connection, Listener

import jax

log = logging.getLogger("gdnspec.multiprocess")

# The methods of `executor.Runtime` the scheduler's steps call that run the device or change host state which later
# device calls read. A warm-up (`--warmup-first`) is not mirrored: every process runs its own engine's, the same
# device calls in the same order, before process 0 starts mirroring (`api.cli`).
MIRRORED = ("step", "forward", "chain", "copy", "release_backlog")
FOLLOWER_GONE_EXIT = 70
_ADDRESS_KEY, _AUTHKEY_KEY = "gdnspec/mirror/address", "gdnspec/mirror/authkey"
_READY_BARRIER = "gdnspec/mirror/ready"
RENDEZVOUS_TIMEOUT_MS = 120_000


def initialize(coordinator: str, num_processes: int, process_id: int) -> None:
    """`jax.distributed.initialize`, with CPU collectives over gloo (TCP; this JAX's CPU backend offers gloo and
    MPI). Call before anything touches a device."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)


def _client():
    """The coordination service's client `jax.distributed.initialize` made (JAX exports no accessor for it)."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return client


class Leader:
    """Process 0's end: sends each mirrored call to every follower before running it; ends the process when a
    follower ends."""

    def __init__(self, host: str):
        n_followers = jax.process_count() - 1
        authkey = secrets.token_bytes(32)
        with Listener((host, 0), authkey=authkey) as listener:
            address = f"{host}:{listener.address[1]}"
            client = _client()
            client.key_value_set_bytes(_AUTHKEY_KEY, authkey)
            client.key_value_set(_ADDRESS_KEY, address)
            # Every follower has built its engine (accept, which cannot time out, then waits only for live ones).
            client.wait_at_barrier(_READY_BARRIER, RENDEZVOUS_TIMEOUT_MS)
            self.followers: dict[int, Connection] = {}
            while len(self.followers) < n_followers:
                connection = listener.accept()
                self.followers[connection.recv()] = connection
        self._lock = threading.Lock()
        self._closing = False
        for process_id, connection in self.followers.items():
            threading.Thread(target=self._watch, args=(process_id, connection), daemon=True,
                             name=f"gdnspec-follower-{process_id}").start()

    def _watch(self, process_id: int, connection: Connection) -> None:
        try:
            why = connection.recv()  # a follower sends only the error that ends it
        except (EOFError, OSError) as exc:
            why = f"its connection closed ({type(exc).__name__})"
        if self._closing:  # told to stop by `close`
            return
        log.critical("follower process %d ended: %s; every step needs its devices, so this server stops",
                     process_id, why)
        logging.shutdown()
        os._exit(FOLLOWER_GONE_EXIT)

    def mirror(self, runtime) -> None:
        """Make runtime's MIRRORED methods send themselves to the followers before they run."""
        for name in MIRRORED:
            setattr(runtime, name, self._mirrored(name, getattr(runtime, name)))

    def _mirrored(self, name: str, method):
        def call(*args, **kwargs):
            with self._lock:
                for connection in self.followers.values():
                    connection.send((name, args, kwargs))
            return method(*args, **kwargs)

        return call

    def close(self) -> None:
        """Tell the followers to stop (they return from `follow`)."""
        with self._lock:
            self._closing = True
            for connection in self.followers.values():
                try:
                    connection.send(None)
                except OSError:
                    pass


def follow(runtime) -> None:
    """A follower's loop: run on runtime each call process 0 sends, until it says stop. Ends the process when
    process 0 is gone; a call that fails is reported to process 0 (which stops) and re-raised."""
    client = _client()
    client.wait_at_barrier(_READY_BARRIER, RENDEZVOUS_TIMEOUT_MS)
    authkey = client.blocking_key_value_get_bytes(_AUTHKEY_KEY, RENDEZVOUS_TIMEOUT_MS)
    host, port = client.blocking_key_value_get(_ADDRESS_KEY, RENDEZVOUS_TIMEOUT_MS).rsplit(":", 1)
    with Client((host, int(port)), authkey=authkey) as connection:
        connection.send(jax.process_index())
        while True:
            try:
                message = connection.recv()
            except (EOFError, OSError):
                # Not SystemExit: jax.distributed's exit would wait at a shutdown barrier for process 0 first.
                print(f"gdnspec: follower {jax.process_index()}: process 0 is gone", file=sys.stderr, flush=True)
                os._exit(1)
            if message is None:
                return
            name, args, kwargs = message
            try:
                getattr(runtime, name)(*args, **kwargs)
            except BaseException as exc:
                connection.send(f"{name} failed on follower {jax.process_index()}: {exc!r}")
                raise


def listen_host(coordinator: str) -> str:
    """The host part of a coordinator address, where process 0 also listens for its followers."""
    host = coordinator.rsplit(":", 1)[0].strip("[]")
    return socket.gethostbyname(host) if host != "localhost" else "127.0.0.1"
