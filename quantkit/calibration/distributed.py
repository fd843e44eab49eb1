"""Calibration spread over the processes of a torchrun job (torch.distributed: NCCL on GPUs, gloo on CPU).

    torchrun --nproc-per-node 4 -m quantkit.cli quantize MODEL -o OUT --method gptq ...

Every rank runs the same block loop on its own contiguous share of the calibration samples (the block forwards,
the bulk of the work at real sample counts, are split). After a stage is observed, the ranks sum their
statistics (GPTQ's Hessian H = 2/N Σ x xᵀ, weighted by each rank's token count), so every rank holds the
Hessian a single process would have accumulated, up to float summation order. Each rank then quantizes its
share of the stage's linears (round robin) and sends the results to all (every rank needs the quantized
weights for the next stage's inputs); rank 0 alone writes the checkpoint. Without torchrun (WORLD_SIZE unset
or 1) every method here is a no-op and nothing is imported from torch.distributed.

`quantkit quantize --processes N` starts the same N processes itself (launch_local: torchrun's launcher used as
a library), so one machine's GPUs are used without a torchrun command line.
"""
import contextlib
import datetime
import io
import logging
import os
import re
import sys

import torch

from quantkit.algorithms.registry import method_spec
from quantkit.core.errors import QuantkitError, StoppedFromOutside, first_line

COLLECTIVE_TIMEOUT = datetime.timedelta(hours=2)  # how long a rank waits for the others (NCCL's default: 10 minutes)


class Group:
    """The ranks of the run: rank/world, and the few collective steps the block loop needs."""

    def __init__(self, rank: int = 0, world: int = 1, owns_process_group: bool = False, device: str = "cpu"):
        self.rank, self.world, self.device = rank, world, device
        self.owns_process_group = owns_process_group  # started by from_environment (not by the caller's code)

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def split(self, input_ids: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous share of the calibration samples [nsamples, seqlen]."""
        if not self.active:
            return input_ids
        check_shareable(input_ids.shape[0], self.world)
        return input_ids.tensor_split(self.world)[self.rank]

    def owner(self, index: int) -> int:
        """The rank that quantizes the index-th linear of a stage."""
        return index % self.world

    def reduce_statistics(self, observers) -> None:
        """Sum each distinct Hessian over the ranks, weighted by token counts: H = Σ_r n_r H_r / Σ_r n_r."""
        if not self.active:
            return
        with _collective("summing the Hessians"):
            _sum_hessians(observers)
        for obs in observers:  # the sharers see the reduced count too
            obs.nsamples = next(o.nsamples for o in observers if o.H is obs.H)

    def sum_counts(self, counts: torch.Tensor) -> None:
        """Sum an integer tensor over the ranks, in place (each rank counted its share of the samples)."""
        if not self.active:
            return
        import torch.distributed as dist

        with _collective("counting the tokens routed to the experts"):
            dist.all_reduce(counts)

    def broadcast(self, obj, src: int, what: str = "sending the quantized layers"):
        """obj of rank `src` on every rank, its tensors on this rank's device: a GPU tensor pickled as it is would
        come back on the sender's GPU (a second CUDA context there, and a device mismatch on the next step)."""
        if not self.active:
            return obj
        import torch.distributed as dist

        box = [to_bytes(obj) if self.rank == src else None]
        with _collective(what):
            dist.broadcast_object_list(box, src=src)
        return obj if self.rank == src else from_bytes(box[0], self.device)

    def close(self) -> None:
        """Tear down the process group this module started, while Python is still whole: a process that exits with
        it alive can abort in gloo's teardown ('terminate called without an active exception', SIGABRT, after the
        work is done; pytorch/pytorch#190489), which torchrun reports as a failed run. It made that rarer, not
        impossible: the quantize command also leaves with leave_now()."""
        if self.owns_process_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self.owns_process_group = False


SINGLE = Group()


def _sum_hessians(observers) -> None:
    import torch.distributed as dist

    seen = set()
    for obs in observers:
        if id(obs.H) in seen:  # shared by linears fed the same tensor: reduced once
            continue
        seen.add(id(obs.H))
        count = torch.tensor([float(obs.nsamples)], dtype=torch.float64, device=obs.H.device)
        dist.all_reduce(count)
        obs.H.mul_(obs.nsamples)
        dist.all_reduce(obs.H)
        obs.H.div_(float(count))
        obs.nsamples = int(count.item())


@contextlib.contextmanager
def _collective(what: str):
    """A collective step whose peer died (killed, out of memory, its own error) fails in gloo/NCCL with a transport
    error: one line instead, and the run's finished blocks are kept (StoppedFromOutside)."""
    try:
        yield
    except RuntimeError as e:
        if type(e).__name__ == "OutOfMemoryError":  # this process's own: reported as such
            raise
        raise StoppedFromOutside(f"another process of the run stopped while {what} ({_transport_error(e)}); the "
                                 "lines around this one say which and why") from e


def _transport_error(e: BaseException) -> str:
    """gloo's '[/path/pair.cc:537] Read error [127.0.0.1]:40122: Connection reset by peer. This is typically...'
    as 'Read error [127.0.0.1]:40122: Connection reset by peer'."""
    return re.sub(r"^\[[^\]]*\]\s*", "", first_line(e)).split(". ")[0][:160]


def to_bytes(obj) -> bytes:
    """obj (any picklable object holding tensors on any device) as torch.save's bytes."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes, device) -> object:
    """to_bytes' object back, every tensor on `device` (quantkit's own objects: not weights_only)."""
    return torch.load(io.BytesIO(data), map_location=device, weights_only=False)


def under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def leave_now() -> None:
    """End a torchrun process whose work is done (its files closed, its process group ended) without Python's and
    C++'s teardown: gloo can still abort there ('terminate called without an active exception', SIGABRT) even after
    destroy_process_group — once in 12 two-rank test runs here — and torchrun then reports a finished run
    as failed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def check_supported(config, resume: bool) -> None:
    """What a run over several processes can do: GPTQ-style calibration (summed Hessians), not AWQ's search, not
    --resume. Checked before any process starts."""
    if resume:
        raise QuantkitError("--resume is not supported over several processes: resume the run with a single process")
    local = [a.name for a in method_spec(config.method).algorithms() if a.needs_data and not a.distributes]
    if local:
        raise QuantkitError(f"--method {config.method} cannot be spread over processes ({', '.join(local)} needs "
                            "every sample's activations in one place): run it as a single process")


def check_shareable(nsamples: int, processes: int) -> None:
    """Every process needs at least one calibration sample of its own."""
    if nsamples < processes:
        raise QuantkitError(f"--nsamples {nsamples} cannot be shared by {processes} processes: use at least one "
                            "--nsamples per process, or fewer processes")


def launch_local(processes: int, argv: list, device: str) -> int:
    """Run `python -m quantkit.cli *argv` as `processes` ranks of one job on this machine and wait for them: rank
    r on cuda:r when `device` is CUDA (NCCL), all on the CPU otherwise (gloo). Returns the exit code: 0, or the
    first failed rank's (the launcher stops the other ranks when one fails). `device` is already resolved."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if device.startswith("cuda"):
        if device != "cuda":
            raise QuantkitError(f"--processes {processes} puts process r on cuda:r, so --device {device} cannot be "
                                "kept: give --device cuda (and CUDA_VISIBLE_DEVICES to choose the GPUs)")
        if processes > torch.cuda.device_count():
            raise QuantkitError(f"--processes {processes} asks for one GPU per process, but this machine has "
                                f"{torch.cuda.device_count()}: use at most --processes {torch.cuda.device_count()}")
    # torchrun gives each process 1 thread; the CPU's cores shared out serve a CPU run better
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // processes)))
    # the launcher logs every stop (W/E lines with pids, each logger at its own level); the processes' own
    # messages and the line below say what the user needs
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith("torch.distributed.elastic") and isinstance(logger, logging.Logger):
            logger.setLevel(logging.CRITICAL)
    try:
        run(parse_args(["--standalone", f"--nproc-per-node={processes}", "-m", "quantkit.cli", *argv]))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()  # the others were stopped because of it
        code = failure.exitcode
        how = (f"stopped with exit code {code}" if code > 0 else  # its error line is above
               f"was killed by signal {-code}{' (the out-of-memory killer sends it)' if code == -9 else ''}")
        print(f"error: process {rank} of {processes} {how}, which ended the run", file=sys.stderr)
        return code if code > 0 else 128 - code
    except SignalException as e:  # Ctrl-C or SIGTERM: the launcher stopped the processes, which said what they kept
        return 128 + int(e.sigval)
    return 0


def without_option(argv: list, option: str) -> list:
    """argv less `option VALUE` and `option=VALUE`."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            kept.append(arg)
    return kept


def from_environment(device: str) -> tuple[Group, str]:
    """(the group, this rank's device) under torchrun; (SINGLE, device) otherwise. Initializes the process group
    once: NCCL when the device is CUDA (rank r on cuda:LOCAL_RANK), gloo on CPU; Group.close() ends it."""
    if not under_torchrun():
        return SINGLE, device
    world = int(os.environ["WORLD_SIZE"])
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise QuantkitError(f"process {rank} wants cuda:{local} but this machine has {torch.cuda.device_count()} "
                                "GPUs: start at most one process per GPU (--nproc-per-node)")
        device = f"cuda:{local}"
        torch.cuda.set_device(device)
    starts = not dist.is_initialized()  # else the caller's own group, left for it to end
    if starts:  # ranks wait in a collective while rank 0 alone measures a --target-bits allocation: minutes, not 10
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo", timeout=COLLECTIVE_TIMEOUT)
    return Group(rank, world, owns_process_group=starts, device=device), device
