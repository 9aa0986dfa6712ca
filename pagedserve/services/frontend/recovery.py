"""The frontend's two sidecars as one thing to (re)synchronise: at startup, and after either was lost.

A sidecar is lost when a call to it fails with UNAVAILABLE (the process died, the socket is gone; or the
executor is not in the frontend's epoch: it restarted) or DEADLINE_EXCEEDED (it stopped answering within the
step deadline); an idle frontend probes for the same. A failed step whose block manager turns out to be
another process (its Stats' instance id changed: it restarted between two calls and knows none of the
frontend's sequences) is a loss too. Any other failure is a bad step, not a lost sidecar.
Synchronising starts a new executor epoch (steps sent before are dropped, never run into blocks handed out
again), empties the block manager, and checks that both still describe the cache and weights the
engine was built for: a sidecar that comes back different is refused, clearly, and the frontend stays down.
A synchronising call that fails names its sidecar (SidecarUnanswered), so that a frontend that gives up after
its recovery timeout can say which one to look at.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Protocol, TypeVar

import grpc

from ..block_manager.client import RemoteBlockManager
from ..block_manager.contract import BlockStats
from ..executor.client import RemoteExecutor
from ..executor.step_types import ExecutorInfo

LOSS_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# what a restarted executor must still have for the engine's requests, limits and prefix namespace to hold
SAME_EXECUTOR = ("model_digest", "dtype", "vocab_size", "max_model_len", "block_size", "num_blocks", "num_cpu_blocks")
T = TypeVar("T")


class SidecarUnanswered(grpc.RpcError):
    """A synchronising call that failed, with the sidecar it went to: gRPC's own error names at most an address
    (a passed deadline not even that), and a frontend that gives up should say which sidecar to look at."""

    def __init__(self, sidecar: str, cause: grpc.RpcError) -> None:
        super().__init__(f"the {sidecar} did not answer: {cause.code().name}")
        self.sidecar, self.cause = sidecar, cause

    def code(self) -> grpc.StatusCode:
        return self.cause.code()

    def details(self) -> str | None:
        return self.cause.details()


def _call(sidecar: str, call: Callable[[], T]) -> T:
    try:
        return call()
    except grpc.RpcError as exc:
        raise SidecarUnanswered(sidecar, exc) from exc


class CacheMismatch(RuntimeError):
    """The sidecars disagree with each other, or one came back with another cache or model."""


class ExecutorRestarted(RuntimeError):
    """The executor answers, but not in the frontend's epoch: it is a new process."""


class BlockManagerRestarted(RuntimeError):
    """The block manager answers, but as another process than the one the frontend synchronised with."""


def is_sidecar_loss(exc: BaseException) -> bool:
    if isinstance(exc, ExecutorRestarted | BlockManagerRestarted):
        return True
    return isinstance(exc, grpc.RpcError) and exc.code() in LOSS_CODES


def check_agreement(info: ExecutorInfo, stats: BlockStats) -> None:
    """The block manager hands out ids of blocks that the executor's tensors must hold."""
    mismatches = [
        f"{name}: executor {ours}, block manager {theirs}"
        for name, ours, theirs in (
            ("block size", info.block_size, stats.block_size),
            ("KV blocks", info.num_blocks, stats.num_total_blocks),
            ("CPU swap blocks", info.num_cpu_blocks, stats.num_cpu_blocks),
        )
        if ours != theirs
    ]
    if mismatches:
        raise CacheMismatch("the block manager and the executor disagree on the KV cache: " + "; ".join(mismatches)
                            + ". Start the block manager with the executor's numbers (see `pagedserve serve`).")


class SidecarSync(Protocol):
    """What the engine loop needs of its sidecars to notice a loss and start over (`Sidecars`; a test's
    in-process stand-in)."""

    def sync(self) -> BlockStats: ...

    def probe(self) -> None: ...

    def check_block_manager(self) -> None: ...


class Sidecars:
    def __init__(self, executor: RemoteExecutor, block_manager: RemoteBlockManager) -> None:
        self.executor, self.block_manager = executor, block_manager
        self.info: ExecutorInfo | None = None  # what the engine was built for, from the first sync
        self.block_manager_id = ""  # the block manager process of the last sync
        # a fresh start point: an executor that outlived an earlier frontend drops that frontend's steps too
        self.epoch = secrets.randbits(62)

    def sync(self) -> BlockStats:
        """Resets both (the executor first: it drains its old steps); CacheMismatch if either changed,
        SidecarUnanswered if either does not answer."""
        self.epoch += 1
        info = _call("executor", lambda: self.executor.reset(self.epoch))
        if self.info is not None:
            changed = [f"{name} {getattr(self.info, name)} -> {getattr(info, name)}"
                       for name in SAME_EXECUTOR if getattr(self.info, name) != getattr(info, name)]
            if changed:
                raise CacheMismatch("the executor came back with another cache or model (" + ", ".join(changed)
                                    + "): refused; restart it with the flags it had, or restart the frontend")
        stats = _call("block manager", self.block_manager.reset)
        check_agreement(info, stats)
        self.info = self.info or info
        self.block_manager_id = stats.instance_id
        return stats

    def probe(self) -> None:
        """Raises a sidecar loss unless both answer, the executor in this epoch (an idle frontend's check)."""
        epoch = self.executor.info().epoch
        if epoch != self.epoch:
            raise ExecutorRestarted(f"the executor is at epoch {epoch}, not {self.epoch}: it restarted")
        self.check_block_manager()

    def check_block_manager(self) -> None:
        """Raises a sidecar loss unless the block manager answers as the process last synchronised."""
        instance = self.block_manager.stats().instance_id
        if instance != self.block_manager_id:
            raise BlockManagerRestarted(f"the block manager is {instance}, not {self.block_manager_id}: it restarted")
