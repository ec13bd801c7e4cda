"""Faults in the libraries beneath the suite, installed from outside it: a test writes a one-line pytest plugin
(PYTEST_PLUGINS, with this folder on the ranks' PYTHONPATH) that calls install(); the plugin patches torch,
torch.distributed, torch.nn.functional or DDP on the ranks before the suite's checks import them. Each fault is
one way a library or a machine can go wrong while every rank still agrees, the kind rank-vs-rank checks miss."""

from __future__ import annotations

import contextlib
import functools
import inspect
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

KiB, MiB = 1 << 10, 1 << 20
FAULTS: dict = {}
_SYNCHRONIZE = torch.cuda.synchronize  # torch's own, whatever a fault patches


def fault(name):
    def register(patch):
        FAULTS[name] = patch
        return patch
    return register


def install(names, rank: int = 1) -> None:
    """Patch the libraries with each named fault; faults of one rank hit `rank` only."""
    for name in names:
        FAULTS[name](rank)


def _on(rank: int) -> bool:
    return dist.is_initialized() and dist.get_rank() == rank


def _toward_zero(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`exact` (float64) in `dtype`, rounded toward zero instead of to nearest."""
    nearest = exact.to(dtype)
    over = nearest.double().abs() > exact.abs()
    bits = nearest.view(torch.int16)  # bf16 and fp16: one less in the bit pattern is one ulp toward zero
    return torch.where(over, (bits - 1).view(dtype), nearest)


@fault("sum-truncates")
def _sum_truncates(_rank):
    """bf16/fp16 all_reduce sums round toward zero (on every rank alike)."""
    real = dist.all_reduce

    @functools.wraps(real)
    def all_reduce(tensor, op=dist.ReduceOp.SUM, *args, **kwargs):
        if tensor.dtype not in (torch.bfloat16, torch.float16) or op != dist.ReduceOp.SUM:
            return real(tensor, op, *args, **kwargs)
        wide = tensor.double()
        work = real(wide, op, *args, **kwargs)
        tensor.copy_(_toward_zero(wide, tensor.dtype))
        return work
    dist.all_reduce = all_reduce


@fault("mid-range-corrupts")
def _mid_range_corrupts(_rank):
    """all_reduce corrupts one element of messages of 64 KiB..4 MiB whose size is a multiple of 4 KiB."""
    real = dist.all_reduce

    @functools.wraps(real)
    def all_reduce(tensor, *args, **kwargs):
        work = real(tensor, *args, **kwargs)
        nbytes = tensor.numel() * tensor.element_size()
        if 64 * KiB <= nbytes <= 4 * MiB and nbytes % (4 * KiB) == 0:
            tensor.view(-1)[tensor.numel() // 2] += 1
        return work
    dist.all_reduce = all_reduce


@fault("all-reduce-slow")
def _all_reduce_slow(rank):
    """One rank's all_reduce of 256 KiB and more takes half a second longer (a link that crawls): every rank waits
    for it, and the sweep's largest message reads some 0.0005 GB/s."""
    real = dist.all_reduce

    @functools.wraps(real)
    def all_reduce(tensor, *args, **kwargs):
        if _on(rank) and tensor.numel() * tensor.element_size() >= 256 * KiB:
            time.sleep(0.5)
        return real(tensor, *args, **kwargs)
    dist.all_reduce = all_reduce


@fault("reduce-scatter-avg-sums")
def _reduce_scatter_avg_sums(_rank):
    """reduce_scatter with AVG (what FSDP uses) returns the sum."""
    real = dist.reduce_scatter_tensor

    @functools.wraps(real)
    def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, *args, **kwargs):
        return real(output, input, dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op, *args, **kwargs)
    dist.reduce_scatter_tensor = reduce_scatter_tensor


@fault("all-gather-stale")
def _all_gather_stale(_rank):
    """all_gather returns the previous same-shaped call's data (a stale buffer)."""
    real, previous = dist.all_gather_into_tensor, {}

    @functools.wraps(real)
    def all_gather_into_tensor(output, input, *args, **kwargs):
        work = real(output, input, *args, **kwargs)
        key = (tuple(output.shape), output.dtype, output.device)
        fresh = output.clone()
        if key in previous:
            output.copy_(previous[key])
        previous[key] = fresh
        return work
    dist.all_gather_into_tensor = all_gather_into_tensor


@fault("conv-zeroes-channels")
def _conv_zeroes_channels(rank):
    """3x3 convolutions zero the last 1/16 of their output channels, on one rank."""
    real = F.conv2d

    @functools.wraps(real)
    def conv2d(input, weight, *args, **kwargs):
        out = real(input, weight, *args, **kwargs)
        if _on(rank) and tuple(weight.shape[-2:]) == (3, 3):
            out[:, out.shape[1] - out.shape[1] // 16:] = 0
        return out
    F.conv2d = conv2d


@fault("conv-reads-a-neighbour")
def _conv_reads_a_neighbour(_rank):
    """Convolutions add 1e-3 of their neighbour's output along the width (a kernel reading one column off), on
    every rank alike: only a reference on another path sees it."""
    real = F.conv2d

    @functools.wraps(real)
    def conv2d(*args, **kwargs):
        out = real(*args, **kwargs)
        return out + 1e-3 * out.roll(1, dims=-1)
    F.conv2d = conv2d


@fault("batch-norm-momentum-doubled")
def _batch_norm_momentum_doubled(_rank):
    """BatchNorm updates its running statistics with twice the momentum asked for, on every rank alike: the
    forward is right, only the buffers are wrong."""
    real = F.batch_norm
    signature = inspect.signature(real)

    @functools.wraps(real)
    def batch_norm(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        bound.arguments["momentum"] *= 2
        return real(*bound.args, **bound.kwargs)
    F.batch_norm = batch_norm


@fault("compile-wrong-later")
def _compile_wrong_later(_rank):
    """torch.compile: right on the first call, wrong on later ones."""
    real = torch.compile

    @functools.wraps(real)
    def compile(fn=None, *args, **kwargs):
        compiled = real(fn, *args, **kwargs)
        calls = []

        def wrapper(*a, **k):
            calls.append(1)
            out = compiled(*a, **k)
            return out if len(calls) == 1 else out + 1e-2
        return wrapper
    torch.compile = compile


@fault("big-gemm-wrong")
def _big_gemm_wrong(_rank):
    """GEMMs of 4096 x 4096 and larger come out wrong in one element (a bad GPU, every rank alike)."""
    real_matmul, real_op = torch.matmul, torch.Tensor.__matmul__

    def spoil(a, b, out):
        if a.dim() == 2 and b.dim() == 2 and min(a.shape[0], b.shape[1]) >= 4096:
            out[1, 2] += 1
        return out

    def matmul(a, b, *, out=None):
        result = real_matmul(a, b, out=out) if out is not None else real_matmul(a, b)
        return spoil(a, b, result)

    torch.matmul = matmul
    torch.Tensor.__matmul__ = lambda a, b: spoil(a, b, real_op(a, b))


@fault("ddp-broadcast-lost")
def _ddp_broadcast_lost(rank):
    """DDP's start-up broadcast of rank 0's weights (and its buffer broadcasts) never arrive on one rank."""
    real = dist._broadcast_coalesced

    def broadcast_coalesced(group, tensors, *args, **kwargs):
        kept = [t.detach().clone() for t in tensors] if _on(rank) else None
        result = real(group, tensors, *args, **kwargs)
        if kept is not None:
            with torch.no_grad():
                for tensor, old in zip(tensors, kept, strict=True):
                    tensor.copy_(old)
        return result
    dist._broadcast_coalesced = broadcast_coalesced


def _ddp_hook(hook):
    real = DistributedDataParallel.__init__

    @functools.wraps(real)
    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self.register_comm_hook(None, hook)
    DistributedDataParallel.__init__ = init


def _all_reduce_then(buffer, after):
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: after(fut.value()[0]))


@fault("ddp-summed")
def _ddp_summed(_rank):
    """DDP's gradients summed over the ranks instead of averaged."""
    _ddp_hook(lambda _state, bucket: _all_reduce_then(bucket.buffer(), lambda summed: summed))


@fault("ddp-divided-twice")
def _ddp_divided_twice(_rank):
    """DDP's gradients divided by the world size twice."""
    def hook(_state, bucket):
        world = dist.get_world_size()
        return _all_reduce_then(bucket.buffer().div_(world), lambda summed: summed.div_(world))
    _ddp_hook(hook)


@fault("ddp-wrong-contribution")
def _ddp_wrong_contribution(rank):
    """One rank hands DDP's all_reduce a wrong local gradient (doubled): every rank gets the same wrong mean."""
    def hook(_state, bucket):
        buffer = bucket.buffer()
        if _on(rank):
            buffer.mul_(2)
        return _all_reduce_then(buffer.div_(dist.get_world_size()), lambda summed: summed)
    _ddp_hook(hook)


@fault("ddp-mean-differs-on-one-rank")
def _ddp_mean_differs_on_one_rank(rank):
    """DDP's averaged gradient arrives 1e-3 off on one rank only (the all_reduce's result corrupted on its way to
    that GPU): its gradients, and then its weights, leave the others'."""
    def hook(_state, bucket):
        def mean(summed):
            summed.div_(dist.get_world_size())
            return summed.add_(1e-3) if _on(rank) else summed
        return _all_reduce_then(bucket.buffer(), mean)
    _ddp_hook(hook)


@fault("checkpoint-load-corrupts")
def _checkpoint_load_corrupts(rank):
    """One rank reads a checkpoint with its first floating tensor off by one (a bad read of the shared file)."""
    real = torch.load

    @functools.wraps(real)
    def load(*args, **kwargs):
        state = real(*args, **kwargs)
        if _on(rank) and isinstance(state, dict):
            first = next(v for v in state.values() if torch.is_tensor(v) and v.is_floating_point())
            first.add_(1)
        return state
    torch.load = load


@fault("sampler-overlaps")
def _sampler_overlaps(rank):
    """One rank's DistributedSampler yields rank 0's shard (a seed or rank wired wrong): samples twice, others never."""
    real = torch.utils.data.DistributedSampler.__iter__

    def iterate(self):
        if _on(rank):
            self.rank = 0
        return real(self)
    torch.utils.data.DistributedSampler.__iter__ = iterate


@fault("loss-not-finite")
def _loss_not_finite(rank):
    """One rank's cross-entropy comes back NaN (a kernel's overflow)."""
    real = F.cross_entropy

    @functools.wraps(real)
    def cross_entropy(*args, **kwargs):
        loss = real(*args, **kwargs)
        return loss * float("nan") if _on(rank) else loss
    F.cross_entropy = cross_entropy


@fault("capture-breaks")
def _capture_breaks(_rank):
    """An all_reduce that cannot be captured in a CUDA graph: it synchronizes the device, which CUDA refuses
    while a stream captures. Needs 2 GPUs (the graph check is multi-rank): not run in CI."""
    real = dist.all_reduce

    @functools.wraps(real)
    def all_reduce(tensor, *args, **kwargs):
        if tensor.is_cuda and torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize(tensor.device)
        return real(tensor, *args, **kwargs)
    dist.all_reduce = all_reduce


def _flip_middle_byte(tensor) -> None:
    flat = tensor.reshape(-1).view(torch.uint8)
    flat[flat.numel() // 2:flat.numel() // 2 + 1].bitwise_xor_(0x10)


class _Waited:
    """A work already waited on: waiting again returns at once."""

    def __init__(self, work):
        self._work = work

    def wait(self, *args, **kwargs):
        return True

    def __getattr__(self, name):
        return getattr(self._work, name)


@fault("send-recv-corrupts")
def _send_recv_corrupts(rank):
    """What one rank receives by send/recv (batch_isend_irecv, pipeline parallelism's path) arrives with one
    byte wrong."""
    real = dist.batch_isend_irecv

    @functools.wraps(real)
    def batch_isend_irecv(p2p_op_list):
        works = real(p2p_op_list)
        if not _on(rank):
            return works
        for work in works:
            work.wait()
        for op in p2p_op_list:
            if op.op is dist.irecv and op.tensor.numel():
                _flip_middle_byte(op.tensor)
        return [_Waited(work) for work in works]  # gloo's send/recv work blocks when waited on twice
    dist.batch_isend_irecv = batch_isend_irecv


@fault("all-to-all-corrupts")
def _all_to_all_corrupts(rank):
    """all_to_all_single delivers one byte wrong on one rank (expert parallelism's path)."""
    real = dist.all_to_all_single

    @functools.wraps(real)
    def all_to_all_single(output, input, *args, **kwargs):
        work = real(output, input, *args, **kwargs)
        if _on(rank) and output.numel():
            _flip_middle_byte(output)
        return work
    dist.all_to_all_single = all_to_all_single


def _copy_corrupts(rank, matches, at_least: int = 64 * MiB):
    """Tensor.copy_ delivers one byte wrong on one rank when `matches(dst, src)` and the buffer is large."""
    real = torch.Tensor.copy_

    @functools.wraps(real)
    def copy_(self, src, non_blocking=False):
        out = real(self, src, non_blocking)
        if _on(rank) and self.numel() * self.element_size() >= at_least and matches(self, src):
            if not self.is_cuda:
                torch.cuda.synchronize()  # the copy into host memory is done before the byte is spoiled
            _flip_middle_byte(self)
        return out
    torch.Tensor.copy_ = copy_


@fault("h2d-copy-corrupts")
def _h2d_copy_corrupts(rank):
    """Host-to-device copies from pinned memory land with one byte wrong (a DMA / IOMMU / riser fault)."""
    _copy_corrupts(rank, lambda dst, src: dst.is_cuda and not src.is_cuda and src.is_pinned())


@fault("d2h-copy-corrupts")
def _d2h_copy_corrupts(rank):
    """Device-to-host copies into pinned memory land with one byte wrong."""
    _copy_corrupts(rank, lambda dst, src: src.is_cuda and not dst.is_cuda and dst.is_pinned())


@fault("d2d-copy-corrupts")
def _d2d_copy_corrupts(rank):
    """Device-to-device copies of large byte buffers land with one byte wrong (a bad HBM channel, a copy
    engine)."""
    _copy_corrupts(rank, lambda dst, src: dst.is_cuda and src.is_cuda and dst.dtype == src.dtype == torch.uint8)


@fault("compile-returns-eager")
def _compile_returns_eager(_rank):
    """torch.compile hands back the eager function (what dynamo's suppress_errors fallback amounts to)."""
    def compile(fn=None, *args, **kwargs):
        return fn if fn is not None else (lambda f: f)
    torch.compile = compile


def _patch_gemms(spoil) -> None:
    """torch.matmul, the @ operator, F.linear and torch._scaled_mm each pass their result through
    `spoil(a, b, out, k)` (a, b as the caller gave them, k the contracted size)."""
    real_matmul, real_op, real_linear = torch.matmul, torch.Tensor.__matmul__, F.linear
    real_scaled = getattr(torch, "_scaled_mm", None)

    @functools.wraps(real_matmul)
    def matmul(a, b, **kwargs):
        return spoil(a, b, real_matmul(a, b, **kwargs), a.shape[-1])

    @functools.wraps(real_linear)
    def linear(x, weight, *args, **kwargs):
        return spoil(x, weight, real_linear(x, weight, *args, **kwargs), x.shape[-1])

    torch.matmul, F.linear = matmul, linear
    torch.Tensor.__matmul__ = lambda a, b: spoil(a, b, real_op(a, b), a.shape[-1])
    if real_scaled is not None:
        @functools.wraps(real_scaled)
        def scaled_mm(a, b, *args, **kwargs):
            return spoil(a, b, real_scaled(a, b, *args, **kwargs), a.shape[-1])
        torch._scaled_mm = scaled_mm


@fault("half-gemm-wrong-at-large-k")
def _half_gemm_wrong_at_large_k(_rank):
    """GEMMs in fp16, bf16 or fp8 with K >= 2048 (a split-K / stream-K kernel) are off by one in one element of
    their result, on every rank alike; fp32 and small K are right."""
    halves = {torch.float16, torch.bfloat16, *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2")
                                               if hasattr(torch, n))}

    def spoil(a, b, out, k):
        if a.dtype in halves and k >= 2048 and out.dim() == 2:
            out[0, 1] += 1
        return out
    _patch_gemms(spoil)


@fault("attention-head-wrong")
def _attention_head_wrong(_rank):
    """scaled_dot_product_attention computes its last head with the scale 1 instead of 1/sqrt(head size) (a
    kernel wrong for one head), forward and so backward, on every rank and every backend alike."""
    real = F.scaled_dot_product_attention

    @functools.wraps(real)
    def sdpa(query, key, value, *args, **kwargs):
        out = real(query, key, value, *args, **kwargs)
        if query.dim() != 4 or query.shape[1] < 2:
            return out
        last = real(query[:, -1:], key[:, -1:], value[:, -1:], *args, **{**kwargs, "scale": 1.0})
        return torch.cat([out[:, :-1], last], dim=1)
    F.scaled_dot_product_attention = sdpa


@fault("adamw-decays-twice")
def _adamw_decays_twice(_rank):
    """torch.optim.AdamW applies its weight decay twice per step (decoupled, and once more), in every form."""
    real = torch.optim.AdamW.step

    @functools.wraps(real)
    def step(self, *args, **kwargs):
        with torch.no_grad():
            for group in self.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.mul_(1 - group["lr"] * group["weight_decay"])
        return real(self, *args, **kwargs)
    torch.optim.AdamW.step = step


@fault("sub-group-corrupts")
def _sub_group_corrupts(rank):
    """Collectives on a group other than the default one (a communicator split off for tensor, pipeline or data
    parallelism) deliver one element off by one on one rank; the default group's are right."""
    for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
        real = getattr(dist, name)
        signature = inspect.signature(real)

        def patched(output, *args, _real=real, _signature=signature, **kwargs):
            work = _real(output, *args, **kwargs)
            group = _signature.bind(output, *args, **kwargs).arguments.get("group")
            if _on(rank) and group is not None and group is not dist.group.WORLD and output.numel():
                output.view(-1)[output.numel() // 2] += 1
            return work
        setattr(dist, name, functools.wraps(real)(patched))
    real_batch = dist.batch_isend_irecv

    @functools.wraps(real_batch)
    def batch_isend_irecv(p2p_op_list):
        works = real_batch(p2p_op_list)
        spoiled = [op for op in p2p_op_list if op.op is dist.irecv and op.group is not None
                   and op.group is not dist.group.WORLD and op.tensor.numel()]
        if not (_on(rank) and spoiled):
            return works
        for work in works:
            work.wait()
        for op in spoiled:
            op.tensor.view(-1)[op.tensor.numel() // 2] += 1
        return [_Waited(work) for work in works]
    dist.batch_isend_irecv = batch_isend_irecv


@fault("no-sync-loses-gradients")
def _no_sync_loses_gradients(_rank):
    """DDP's no_sync drops the gradients accumulated inside it (gradient accumulation keeps the last micro-batch
    only), on every rank alike."""
    real = DistributedDataParallel.no_sync

    @contextlib.contextmanager
    def no_sync(self):
        with real(self):
            yield
        for param in self.module.parameters():
            param.grad = None
    DistributedDataParallel.no_sync = no_sync

def _called_from_a_check() -> bool:
    """Whether the caller's stack passes through the suite (smoke_tests/): a hang there is inside a check, where
    the watchdog looks, not in the ranks' start-up."""
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        if "smoke_tests" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _never_return() -> None:
    """A call that never returns, as a hung machine makes it: on a GPU rank a kernel that never ends and the host
    waiting for it in CUDA (what a GPU stuck after an XID looks like from the rank); on a CPU rank the thread blocked
    on a lock nobody releases (a collective whose peer's data never comes)."""
    import threading

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        while True:
            torch.cuda._sleep(1 << 34)  # ~10 s of spinning per launch, the GPU busy all along (NVML: 100 %)
            _SYNCHRONIZE()
    threading.Event().wait()


@fault("collective-hangs")
def _collective_hangs(rank):
    """One rank's send/recv, barrier and all_reduce never return once called inside a check: its peers wait in
    the collective, it is stuck below it."""
    for name in ("batch_isend_irecv", "barrier", "all_reduce"):
        real = getattr(dist, name)

        def hang(*args, _real=real, **kwargs):
            if _on(rank) and _called_from_a_check():
                _never_return()
            return _real(*args, **kwargs)
        setattr(dist, name, functools.wraps(real)(hang))


@fault("kernel-hangs")
def _kernel_hangs(rank):
    """One rank's torch.cuda.synchronize never returns once called inside a check (a kernel that never ends): one
    GPU is enough."""
    real = torch.cuda.synchronize

    @functools.wraps(real)
    def synchronize(*args, **kwargs):
        if (not dist.is_initialized() or dist.get_rank() == rank) and _called_from_a_check():
            _never_return()
        return real(*args, **kwargs)
    torch.cuda.synchronize = synchronize
