"""Running the study's samples and the evaluation's rows on a Ray cluster.

Every sample of ``kvqrs study`` (a cell x seed, or a cell x captured head) and every row of
``kvqrs eval`` is independent of the others and fully determined by its inputs (the codecs are
seeded, the Rust kernels give the same bytes under any thread count), so they can run anywhere.
These helpers send them to the cluster's workers as Ray tasks (the study) or to actors that each
hold the model (the evaluation), and put the results back in the serial run's order: the rows,
and so the report, are the same as without Ray. Every node needs kvqrs installed (and, for the
evaluation, ``kvqrs[eval]`` and the model package).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Sequence
from typing import Any

from .._arrays import KvqrsError

LOCAL = "local"
"""``--ray local``: start a Ray cluster inside this process for the run (all local cores)."""


def connect(address: str):
    """Connect to the Ray cluster at ``address`` and return the ``ray`` module.

    ``address``: ``"auto"`` (the cluster started on this machine by ``ray start``, or the one
    ``RAY_ADDRESS`` names), ``"HOST:PORT"`` (a cluster's GCS address), ``"ray://HOST:PORT"``
    (Ray Client) or ``"local"`` (a new single-machine cluster for this process). Already
    connected (``ray.init`` called before): that connection is used. Raises KvqrsError when Ray
    is not installed or no cluster answers at ``address``.
    """
    _host_port(address)
    try:
        import ray
    except ModuleNotFoundError as e:
        raise KvqrsError("--ray: Ray is not installed; pip install 'kvqrs[ray]'") from e
    if ray.is_initialized():
        return ray
    _check_reachable(address)
    try:
        ray.init(address=None if address == LOCAL else address, logging_level="error", log_to_driver=False)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise KvqrsError(f"--ray: no Ray cluster at {address!r}: {e}") from e
    return ray


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``HOST:PORT`` or ``ray://HOST:PORT`` address, None for ``auto`` and
    ``local``; raises KvqrsError for anything else."""
    if address in ("auto", LOCAL):
        return None
    host, sep, port = address[len("ray://") :].rpartition(":") if address.startswith("ray://") else address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise KvqrsError(f"--ray: expected 'auto', 'local', HOST:PORT or ray://HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """Refuse an address where nothing listens, at once: ``ray.init`` would keep retrying it
    for minutes."""
    hp = _host_port(address)
    if hp is None:
        return
    try:
        socket.create_connection(hp, timeout=timeout).close()
    except OSError as e:
        raise KvqrsError(f"--ray: no Ray cluster at {address!r}: {e}") from e


@contextlib.contextmanager
def original_errors(ray):
    """Re-raise a task's or actor's exception as the worker raised it (a KvqrsError stays a
    KvqrsError with its own message, not Ray's wrapper with the remote traceback)."""
    try:
        yield
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, Exception):
            raise cause from None
        raise


def cluster_cpus(ray) -> int:
    """CPUs the connected cluster offers (at least 1)."""
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def map_chunks(
    ray, fn: Callable[..., list], chunks: Sequence[Sequence], shared: Sequence[Any] = (), progress: bool = True, desc: str = ""
) -> list:
    """``[*fn(*shared, chunks[0]), *fn(*shared, chunks[1]), ...]`` with each call a Ray task.

    ``fn`` returns a list per chunk; the lists are joined in chunk order, whatever order the
    tasks finish in. ``shared`` arguments are put in the object store once, not per task. A
    task's exception is raised here as it was raised on the worker (:func:`original_errors`).
    """
    from tqdm import tqdm

    remote = ray.remote(num_cpus=1)(fn)
    shared_refs = [ray.put(x) for x in shared]  # sent to each node once, not with every task
    refs = [remote.remote(*shared_refs, list(c)) for c in chunks]
    index = {r: i for i, r in enumerate(refs)}
    parts: list[list | None] = [None] * len(refs)
    pending = list(refs)
    with original_errors(ray), tqdm(total=sum(len(c) for c in chunks), desc=desc, unit="sample", disable=not progress) as bar:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for r in done:
                i = index[r]
                parts[i] = ray.get(r)
                bar.update(len(chunks[i]))
    return [x for part in parts for x in part]


def map_actors(
    ray, actor_cls: type, init_args: Sequence[Any], items: Sequence, method: str, count: int, cpus: int, progress: bool, desc: str
):
    """``[actor.method(item) for item in items]`` over ``count`` actors of ``actor_cls``
    (``actor_cls(*init_args)``, each reserving ``cpus`` CPUs); items go to whichever actor is
    free, results come back in ``items``' order."""
    from ray.util import ActorPool
    from tqdm import tqdm

    if count < 1:
        raise KvqrsError(f"--ray: expected at least one worker, got {count}")
    cls = ray.remote(num_cpus=cpus)(actor_cls)
    actors = [cls.remote(*init_args) for _ in range(min(count, len(items)))]
    pool = ActorPool(actors)
    try:
        with original_errors(ray):
            return list(
                tqdm(pool.map(lambda a, x: getattr(a, method).remote(x), list(items)), total=len(items), desc=desc, disable=not progress)
            )
    finally:
        for a in actors:
            ray.kill(a)
