"""Who this process is in a data-parallel group, and how rank 0's NCCL id reaches the others.

Launchers say it in the environment:

* ``torchrun`` (and this package's own launcher, which sets the same names): ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``;
* ``mpirun`` (Open MPI): ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``,
  ``OMPI_COMM_WORLD_LOCAL_RANK``, with ``MASTER_ADDR`` and ``MASTER_PORT`` for the rendezvous.

NCCL needs one unique id, made by rank 0, in every rank before the communicator exists.
:func:`rendezvous` carries it over TCP: rank 0 listens at ``MASTER_ADDR:MASTER_PORT`` and hands the
bytes to each of the other ranks, which connect (retrying while rank 0 starts) until a deadline.
A rank that never arrives makes the others fail with a clear error, never hang.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass

from mlptrain.base.errors import ConfigError

_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_OPENMPI = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")
_LAUNCHERS = (("torchrun", _TORCHRUN), ("mpirun", _OPENMPI))


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the group, as the launcher set it."""

    rank: int
    world: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> DistEnv | None:
        """The group the launcher describes in ``env``, or None when no launcher set one.

        Raises:
            ConfigError: a launcher's variables that are missing, not integers or inconsistent, or no
                ``MASTER_ADDR``/``MASTER_PORT`` for the rendezvous (each named with what was expected).
        """
        found = [(launcher, names) for launcher, names in _LAUNCHERS if any(n in env for n in names)]
        if not found:
            return None
        launcher, names = found[0]
        rank, world, local = (_int(env, n, launcher) for n in names)
        if world < 1 or not 0 <= rank < world or local < 0:
            raise ConfigError(
                f"{launcher} set {names[0]}={rank}, {names[1]}={world}, {names[2]}={local}; expected "
                f"0 <= rank < world size and a non-negative local rank"
            )
        addr = env.get("MASTER_ADDR")
        if not addr:
            raise ConfigError(
                f"{launcher} started rank {rank} of {world} without MASTER_ADDR; set MASTER_ADDR and "
                "MASTER_PORT to rank 0's host and a free port (the NCCL id's rendezvous)"
            )
        port = _int(env, "MASTER_PORT", launcher)
        if not 0 < port < 65536:
            raise ConfigError(f"MASTER_PORT={port}; expected a TCP port between 1 and 65535")
        return cls(rank, world, local, addr, port, launcher)


def _int(env: Mapping[str, str], name: str, launcher: str) -> int:
    value = env.get(name)
    if value is None:
        raise ConfigError(f"{launcher} variables are incomplete: {name} is not set")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r}; expected an integer") from None


def exchange_id(
    env: DistEnv, payload: bytes | None, timeout: float = 120.0, environ: Mapping[str, str] | None = None
) -> bytes:
    """NCCL's unique id from rank 0 to every rank, through the launcher's own channel.

    * torchrun: its key-value store, the ``TCPStore`` its agent serves at ``MASTER_ADDR:MASTER_PORT``
      (the port is taken: a server of our own could not listen there);
    * mpirun, or ``MLPTRAIN_RDZV_PORT`` set: :func:`rendezvous` at ``MASTER_ADDR`` and that port
      (default ``MASTER_PORT``).
    """
    environ = os.environ if environ is None else environ
    port = environ.get("MLPTRAIN_RDZV_PORT")
    if env.launcher == "torchrun" and port is None:
        return _torch_store(env, payload, timeout, environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if port is not None:
        try:
            env = dataclasses.replace(env, master_port=int(port))
        except ValueError:
            raise ConfigError(f"MLPTRAIN_RDZV_PORT={port!r}; expected a TCP port number") from None
    return rendezvous(env, payload, timeout)


def _torch_store(env: DistEnv, payload: bytes | None, timeout: float, attempt: str) -> bytes:
    try:
        from torch.distributed import TCPStore
    except ImportError:
        raise ConfigError(
            "started by torchrun, but torch.distributed is not importable here for its store; set "
            "MLPTRAIN_RDZV_PORT to a free port for mlptrain's own rendezvous"
        ) from None
    store = TCPStore(env.master_addr, env.master_port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    key = f"mlptrain/nccl_unique_id/{attempt}"  # an elastic restart makes a new communicator
    if env.rank == 0:
        if payload is None:
            raise ValueError("rank 0 must give the payload to send")
        store.set(key, payload)  # type: ignore[arg-type]  # the binding takes bytes (std::string); its stub says str
        return payload
    return bytes(store.get(key))  # waits for rank 0 (the store's timeout bounds it)


def rendezvous(env: DistEnv, payload: bytes | None, timeout: float = 120.0) -> bytes:
    """Rank 0 sends ``payload`` (the NCCL unique id) to every other rank; every rank returns it.

    Raises:
        TimeoutError: rank 0 did not hear from every rank, or a rank could not reach rank 0, within
            ``timeout`` seconds (the message names the address and who is missing).
    """
    deadline = time.monotonic() + timeout
    if env.rank == 0:
        if payload is None:
            raise ValueError("rank 0 must give the payload to send")
        _serve(env, payload, deadline)
        return payload
    return _fetch(env, deadline)


def _serve(env: DistEnv, payload: bytes, deadline: float) -> None:
    with socket.create_server(("", env.master_port), reuse_port=False) as server:  # every interface: MASTER_ADDR
        # may name this host by an address it does not listen on (a host name resolving to 127.0.1.1)
        served = 0
        while served < env.world - 1:
            server.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                conn, _ = server.accept()
            except TimeoutError:
                raise TimeoutError(
                    f"rendezvous at {env.master_addr}:{env.master_port}: {env.world - 1 - served} of "
                    f"{env.world - 1} ranks never connected"
                ) from None
            with conn:
                conn.sendall(struct.pack("<I", len(payload)) + payload)
            served += 1


def _fetch(env: DistEnv, deadline: float) -> bytes:
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((env.master_addr, env.master_port), timeout=1.0) as conn:
                conn.settimeout(max(0.01, deadline - time.monotonic()))
                (n,) = struct.unpack("<I", _recv(conn, 4))
                return _recv(conn, n)
        except OSError as exc:  # rank 0 not listening yet: try again
            last = exc
            time.sleep(0.05)
    raise TimeoutError(f"rank {env.rank} could not reach rank 0 at {env.master_addr}:{env.master_port} ({last})")


def _recv(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("rank 0 closed the rendezvous connection early")
        data += chunk
    return data
