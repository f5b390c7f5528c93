"""The processes of a tensor-parallel group: rank 0 is the engine, ranks 1..N-1 workers.

    rank 0 (the engine's process)            rank r (a worker process, runner/worker_procs.py)
    ----------------------------             ----------------------------------
    join the group (torch.distributed)       join the group
    load the model, keep shard 0             load the model, keep shard r
    size the KV cache; send the runner spec  receive the runner spec; build the runner
    each step: send it, run it, sample       each step: receive it, run it (collectives pair up)
    shutdown: send the end                   leave

The group is torch.distributed's default group: gloo on CPUs, NCCL on GPUs (rank r on
cuda:r).  Started locally (forked, or spawned once a CUDA context exists: worker_procs.py),
the workers are tied to rank 0's life and the rendezvous is tcp://127.0.0.1 on a free port
(or the one given); under `torchrun` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set), env:// is used
and nothing is spawned: rank 0 serves, the others call `run_worker` (`tokenloom serve`
does this), which is how a group spans machines.  CPU threads are divided between the
ranks on one machine.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import socket
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tokenloom.config import BackendPlan
from tokenloom.model.weights.parallel import TPGroup
from tokenloom.runner.worker_procs import WorkerProcess, Workers

logger = logging.getLogger(__name__)

# A worker waits for the next step as long as the server is idle: no timeout that matters.
_IDLE = datetime.timedelta(days=365)
# Rank 0 never waits idle (it sends the steps); what it waits for -- the rendezvous with the
# workers it started, a worker still loading its shard, a partial sum inside a step -- takes
# seconds to minutes.  A dead worker fails it at once (gloo sees the closed connection); this
# bounds a worker that is alive but stuck.
_RANK0_WAIT = datetime.timedelta(minutes=30)
# How long shutdown waits for the workers to leave after the end is sent.
_STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to load its shard and build its runner (picklable)."""

    path: str
    dtype: str
    device: str  # "cpu" or "cuda" (rank r takes cuda:r)
    max_positions: int
    num_threads: int | None
    backends: BackendPlan | None = None  # rank 0's plan (model/backends.py): workers run what it runs


def worker_spec(args, path: Path, device: torch.device, max_positions: int,
                backends: BackendPlan | None = None) -> WorkerSpec:
    """The worker spec for these engine args (an EngineArgs), resolved model path and backend plan."""
    return WorkerSpec(path=str(path), dtype=args.dtype, device=device.type, max_positions=max_positions,
                      num_threads=args.num_threads, backends=backends)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def _threads(size: int, asked: int | None) -> int:
    if asked:
        return asked
    local = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    return max(1, (os.cpu_count() or 1) // local)


def _join(rank: int, size: int, device: str, init_method: str,
          timeout: datetime.timedelta = _IDLE) -> TPGroup:
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout)
    return TPGroup(rank, size)


def _device(device: str, rank: int) -> torch.device:
    return torch.device(f"cuda:{rank % torch.cuda.device_count()}") if device.startswith("cuda") else torch.device("cpu")


class TPLauncher:
    """Rank 0's handle on the group: starts the workers (unless torchrun did) and joins.

    Started here, the workers die with this process however it ends, and a worker that
    exits before it runs is an error within a second (runner/worker_procs.py); rank 0 waits
    at most `_RANK0_WAIT` for the rendezvous."""

    def __init__(self, size: int, spec: WorkerSpec, port: int | None = None):
        self.size = size
        self._closed = False
        self.workers: Workers | None = None
        self.procs: list[WorkerProcess] = []
        if launched_by_torchrun():
            if int(os.environ["WORLD_SIZE"]) != size:
                raise ValueError(f"--tensor-parallel-size {size} but torchrun started {os.environ['WORLD_SIZE']} "
                                 "processes")
            init, wait = "env://", _IDLE  # the other ranks are torchrun's to start, on its schedule
        else:
            init, wait = f"tcp://127.0.0.1:{port or free_port()}", _RANK0_WAIT
            self.workers = Workers()
            try:
                for rank in range(1, size):
                    self.procs.append(self.workers.start(f"tokenloom-tp{rank}", _worker_main, rank, size, init, spec))
                self.workers.wait_started()
            except BaseException:
                self.workers.kill()
                raise
            # Registered after multiprocessing's own exit hook, so it runs first: the workers are
            # told to stop before multiprocessing would SIGTERM them mid-wait.
            atexit.register(_shutdown_at_exit, weakref.ref(self))
        torch.set_num_threads(_threads(size, spec.num_threads))
        try:
            self.group = _join(0, size, spec.device, init, wait)
        except BaseException:
            if self.workers:
                self.workers.kill()
            raise
        self.spec = spec

    def send_runner_spec(self, num_blocks: int, block_size: int, **runner_kwargs: Any) -> None:
        """The KV cache size and runner settings rank 0 decided once its shard was loaded."""
        dist.broadcast_object_list([(num_blocks, block_size, runner_kwargs)], src=0)

    def abort(self) -> None:
        """Rank 0 failed before the group could work: stop the workers without a handshake."""
        self._closed = True
        if self.workers:
            self.workers.kill()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()

    def shutdown(self) -> None:
        """Send the end, wait for the workers (at most `_STOP_TIMEOUT_S`), leave the group.
        Idempotent; also run when the engine is collected or the process exits.  A worker
        that died already is reported, not waited for."""
        from tokenloom.runner.tp_comm import send_stop

        if self._closed:
            return
        self._closed = True
        try:
            if dist.is_initialized():
                send_stop()
        except RuntimeError as e:  # a worker is gone: gloo saw its connection close
            logger.warning("tensor-parallel shutdown: could not reach every worker (%s)", str(e).splitlines()[0])
        finally:
            if self.workers:
                self.workers.stop(_STOP_TIMEOUT_S)
            if dist.is_initialized():
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()


def _shutdown_at_exit(ref: weakref.ref[TPLauncher]) -> None:
    launcher = ref()
    if launcher is not None:
        launcher.shutdown()


def run_worker(rank: int, size: int, init_method: str, spec: WorkerSpec) -> None:
    """A worker's whole life: join, load shard `rank`, build the runner, run steps until told to stop."""
    from tokenloom.model.weights.loader import load_model
    from tokenloom.runner.model_runner import ModelRunner

    torch.set_num_threads(_threads(size, spec.num_threads))
    tp = _join(rank, size, spec.device, init_method)
    try:
        loaded = load_model(Path(spec.path), spec.dtype, _device(spec.device, rank), max_positions=spec.max_positions,
                            tp=tp, plan=spec.backends)
        box = [None]
        dist.broadcast_object_list(box, src=0)
        num_blocks, block_size, runner_kwargs = box[0]
        runner = ModelRunner(loaded, num_blocks, block_size, tp=tp, **runner_kwargs)
        runner.serve_steps()
    finally:
        dist.destroy_process_group()


def _worker_main(rank: int, size: int, init_method: str, spec: WorkerSpec) -> None:
    run_worker(rank, size, init_method, spec)
