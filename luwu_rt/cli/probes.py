"""The measurements behind ``luwu calibrate``: each probe times one part of this machine as the runtime uses
it and returns plain numbers (GB/s, per second, FLOP/s, seconds).

Each probe warms up first (thread pools, page faults, connections) and reports the median of its
repetitions: the machine may be shared, and one slow repetition should not set a figure.
"""

from __future__ import annotations

import os
import queue
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

__all__ = ["codec_rates", "collectives", "compute_rate", "copy_gbps", "matmul_flops", "mem_gbps", "mixed_io_seconds",
           "nvme", "optimizer_rate", "overlap", "zmq_latency_s", "zmq_protocol_gbps"]

_GB = 1e9
_NVME_BLOCKS_KB = (256, 1024, 4096)
_NVME_DEPTHS = (8, 32, 64)


def _median_time(fn: Callable[[], Any], *, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- disk ------------------------------------------------------------------------------------------

def mixed_io_seconds(directory: str, *, read_bytes: int, write_bytes: int, block_bytes: int, queue_depth: int) -> float:
    """Seconds for one IO engine to read ``read_bytes`` from one file while overwriting ``write_bytes`` of another,
    as the store's read and write queues do at once. Both files are written whole before the clock starts: the
    store overwrites its swap files in place, and writes that extend a file pay ext4's block allocation (1.25x
    the overwrite of the same GiB here), which would make this bound, and every ratio to it, look better."""
    from luwu_rt.io import IOEngine, aligned_empty

    tag = uuid.uuid4().hex
    src, dst = os.path.join(directory, f".luwu-mixed-r-{tag}"), os.path.join(directory, f".luwu-mixed-w-{tag}")
    rbuf, wbuf = aligned_empty(read_bytes), aligned_empty(write_bytes)
    wbuf.fill_(7)
    with IOEngine(block_bytes=block_bytes, queue_depth=queue_depth) as engine:
        try:
            engine.write(src, offset=0, buffer=rbuf)  # the file read back; not timed
            engine.write(dst, offset=0, buffer=wbuf)  # allocated, as the store's files are; not timed
            start = time.perf_counter()
            tickets = [engine.submit_read(src, offset=0, buffer=rbuf), engine.submit_write(dst, offset=0, buffer=wbuf)]
            for t in tickets:
                engine.wait(t)
            return time.perf_counter() - start
        finally:
            for path in (src, dst):
                engine.forget(path)
                if os.path.exists(path):
                    os.unlink(path)


def nvme(directory: str, *, size_bytes: int, repeats: int = 3, log: Callable[[str], None] = lambda _: None) -> dict:
    """Read, write and mixed GB/s of the IO engine on ``directory``'s disk. Sweeps block size and queue depth
    (as DeepSpeed's ``ds_nvme_tune`` does for its aio) and keeps the best of each direction; the figures the
    profile takes are the median of ``repeats`` passes at the best settings, and mixed: a read and a write
    of ``size_bytes`` each at once, at the IO engine's own settings (what the store runs)."""
    import inspect

    import torch

    from luwu_rt.cli.bench_io import measure
    from luwu_rt.io import IOEngine, aligned_empty

    buffer = aligned_empty(size_bytes)
    buffer.copy_(torch.randint(0, 256, (size_bytes,), dtype=torch.uint8))
    check = aligned_empty(size_bytes)
    sweep = []
    for block_kb in _NVME_BLOCKS_KB:
        for depth in _NVME_DEPTHS:
            r = measure(directory, size_bytes=size_bytes, block_bytes=block_kb << 10, queue_depth=depth, buffer=buffer,
                        read_buffer=check)
            sweep.append({"block_kib": block_kb, "queue_depth": depth, "read_gbps": r.read_gbps,
                          "write_gbps": r.write_gbps})
            log(f"nvme block {block_kb} KiB, queue depth {depth}: write {r.write_gbps:.2f} GB/s, read "
                f"{r.read_gbps:.2f} GB/s")
    best = {d: max(sweep, key=lambda s: s[f"{d}_gbps"]) for d in ("read", "write")}
    figures = {}
    for d in ("read", "write"):
        again = [measure(directory, size_bytes=size_bytes, block_bytes=best[d]["block_kib"] << 10,
                         queue_depth=best[d]["queue_depth"], buffer=buffer, read_buffer=check)
                 for _ in range(repeats - 1)]
        figures[d] = statistics.median([best[d][f"{d}_gbps"]] + [getattr(r, f"{d}_gbps") for r in again])
    defaults = {k: v.default for k, v in inspect.signature(IOEngine).parameters.items()}
    block, depth = defaults["block_bytes"], defaults["queue_depth"]
    alone = (size_bytes / (figures["read"] * _GB), size_bytes / (figures["write"] * _GB))
    mixed_s = mixed_io_seconds(directory, read_bytes=size_bytes, write_bytes=size_bytes, block_bytes=block,
                               queue_depth=depth)
    crc_s = checksum_seconds(buffer)
    engine = next(s for s in sweep if s["block_kib"] << 10 == block and s["queue_depth"] == depth)
    return {"read_gbps": figures["read"], "write_gbps": figures["write"], "best": best, "sweep": sweep,
            "engine_settings": {"block_kib": block >> 10, "queue_depth": depth, "read_gbps": engine["read_gbps"],
                                "write_gbps": engine["write_gbps"]},
            "mixed_gbps": 2 * size_bytes / mixed_s / _GB,
            "mixed_over_one_disk": sum(alone) / mixed_s,
            "overlap": disk_overlap(*alone, mixed_s),
            # [Note: shared cores] in plan/cost.py: the cores' time of each GB the store moves is the CRC-32C it
            # computes of every chunk it writes or reads back. The IO engine's own CPU time was negligible here
            # (2 ms of the process's CPU per 0.5 GB read and written at once), and a matmul beside such traffic
            # ran as fast as alone, within the noise of a 2-core machine.
            "checksum_gbps": size_bytes / crc_s / _GB, "core_s_per_gb": crc_s / (size_bytes / _GB)}


def checksum_seconds(buffer, *, chunk_bytes: int = 16 << 20, repeats: int = 3) -> float:
    """Seconds the store's CRC-32C of ``buffer`` (a flat uint8 tensor) takes, chunk by chunk as it checksums a
    shard (median of ``repeats``)."""
    from luwu_rt import _C

    chunks = [c.numpy() for c in buffer.split(chunk_bytes)]
    return _median_time(lambda: [_C.crc32c(c) for c in chunks], repeats=repeats)


def disk_overlap(read_s: float, write_s: float, both_s: float) -> float:
    """``HardwareProfile.nvme_overlap`` from a read and a write timed alone and the same two at once: the share of
    the shorter one's time that hid behind the longer ([Note: one disk] in plan/cost.py), clamped to 0..1."""
    hidden = read_s + write_s - both_s
    return min(max(hidden / min(read_s, write_s), 0.0), 1.0) if min(read_s, write_s) > 0 else 0.0


# -- memory, copies, optimizer, compute ------------------------------------------------------------

def mem_gbps(*, numel: int = 1 << 24, device: str = "cpu", repeats: int = 5) -> float:
    """One streaming pass over ``device``'s memory (``a += b``: two reads, one write), GB/s."""
    import torch

    a, b = torch.ones(numel, device=device), torch.ones(numel, device=device)

    def add():
        a.add_(b)
        if device == "cuda":
            torch.cuda.synchronize()

    return 3 * a.nbytes / _median_time(add, repeats=repeats) / _GB


def copy_gbps(device: str, *, nbytes: int = 64 << 20, repeats: int = 5) -> tuple[float, float]:
    """Host -> device and device -> host copy GB/s (pinned host memory on a GPU; on the CPU the "device" is an
    arena in RAM, and a copy is a memcpy)."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    h2d = _median_time(lambda: (dev.copy_(host, non_blocking=True), sync()), repeats=repeats)
    d2h = _median_time(lambda: (host.copy_(dev, non_blocking=True), sync()), repeats=repeats)
    return nbytes / h2d / _GB, nbytes / d2h / _GB


def optimizer_rate(*, numel: int = 1 << 23, device: str = "cpu", repeats: int = 5) -> float:
    """The fused AdamW step (fp32 params, grads and moments) in parameters per second."""
    import torch

    from luwu_rt.kernels import adamw_step

    p, g, m, v = (torch.rand(numel, device=device) for _ in range(4))
    count = [0]

    def step():
        count[0] += 1
        adamw_step(p, g, m, v, step=count[0], lr=1e-3)
        if device == "cuda":
            torch.cuda.synchronize()

    return numel / _median_time(step, repeats=repeats)


CODEC_PROBES = {"cast": "bf16", "onebit": "onebit", "topk": "topk:0.01", "powersgd": "powersgd:4"}
"""The codec timed for each family of rate keys (``<family>_encode_gbps``; fp16 runs bf16's kernels)."""


def codec_rates(*, numel: int = 1 << 22, chunk_numel: int = 1 << 20, device: str = "cpu", threads: int = 1,
                repeats: int = 5) -> dict[str, float]:
    """Each codec family's encode and decode as ``HardwareProfile`` counts them: GB/s of fp32 gradient read
    by an encode (with its residual) or written by a decode, on ``threads`` threads (torch's and Numba's),
    the share of the cores one rank of several on this machine gets."""
    import torch

    from luwu_rt.compress import codec_for

    grad = torch.randn(numel, generator=torch.Generator().manual_seed(0)).mul_(1e-2).to(device)
    residual, out = torch.zeros(numel, device=device), torch.empty(numel, device=device)

    def timed(fn):
        def run():
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
        return numel * 4 / _median_time(run, repeats=repeats) / _GB

    rates, before = {}, torch.get_num_threads()
    try:
        import numba
        numba_before = numba.get_num_threads()
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    except ImportError:  # the codecs then run in torch
        numba = None
    torch.set_num_threads(threads)
    try:
        for family, name in CODEC_PROBES.items():
            codec = codec_for(name, chunk_numel=chunk_numel)
            payload = torch.empty(codec.payload_bytes(numel), dtype=torch.uint8, device=device)
            residual.zero_()
            rates[f"{family}_encode_gbps"] = timed(lambda c=codec, p=payload: c.encode(grad, residual, p))
            rates[f"{family}_decode_gbps"] = timed(lambda c=codec, p=payload: c.decode(p, out))
    finally:
        torch.set_num_threads(before)
        if numba is not None:
            numba.set_num_threads(numba_before)
    return rates


def matmul_flops(*, n: int = 1024, device: str = "cpu", dtype: str = "fp32", repeats: int = 5) -> float:
    """FLOP/s of an n x n matmul: the device's peak for dense work, for reference beside ``compute_rate``."""
    import torch

    from luwu_rt.engine.workload import COMPUTE_DTYPES

    a = torch.rand(n, n, device=device, dtype=COMPUTE_DTYPES[dtype])
    b = torch.rand(n, n, device=device, dtype=COMPUTE_DTYPES[dtype])

    def mm():
        torch.mm(a, b)
        if device == "cuda":
            torch.cuda.synchronize()

    return 2 * n**3 / _median_time(mm, repeats=repeats)


def compute_rate(model: str, *, batch_size: int, seq_len: int, dtype: str = "fp32", steps: int = 4,
                 keep_graphs: str = "auto", ranks: int = 1, start: Callable[[], object] | None = None) -> dict:
    """The FLOP/s the cost model should take for ``model``: the plan's FLOPs of a step over the compute queue's
    busy time in real steps of the engine (units forward and backward as the engine runs them: kept graphs,
    recompute, attention and the elementwise work a matmul rate leaves out). Every state on the device tier
    but the optimizer's, which runs on its own queue after the backward (clipping on), so that the compute
    queue does the model's work alone. ``ranks`` > 1: measured by that many ranks side by side on this
    machine's cores ([Note: the compute rate of ranks side by side]); ``start``: called once the engine is
    set up, before the timed steps."""
    if ranks > 1:
        return _side_by_side(ranks, dict(model=model, batch_size=batch_size, seq_len=seq_len, dtype=dtype,
                                         steps=steps, keep_graphs=keep_graphs))
    import torch

    from luwu_rt.config import from_mapping
    from luwu_rt.engine import Engine, TrainConfig
    from luwu_rt.plan.ops import Compute

    from luwu_rt.engine.budgets import available_memory_bytes

    free = available_memory_bytes()  # budgets, not allocations: the arenas take what the plan needs
    config = from_mapping(TrainConfig, {
        "model": model, "batch_size": batch_size, "seq_len": seq_len, "dtype": dtype, "steps": steps + 1,
        "keep_graphs": keep_graphs, "profile": "builtin", "optim": {"grad_clip": 1.0},
        "offload": {"params": "device", "grads": "device", "optimizer": "host", "device_mem": free // 2,
                    "host_mem": free // 4}})
    with Engine(None, config) as engine:
        vocab = engine.chain.shape.vocab_size if getattr(engine.chain, "shape", None) else 256
        g = torch.Generator().manual_seed(0)
        if start is not None:
            start()
        busy = []
        for _ in range(steps + 1):
            data = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=g)
            m = engine.train_step((data[:, :-1], data[:, 1:]))
            busy.append(m["compute_s"])
        flops = sum(op.flops for op in engine.plan.ops if isinstance(op, Compute))
    compute_s = statistics.median(busy[1:])
    return {"model": model, "batch_size": batch_size, "seq_len": seq_len, "dtype": dtype, "step_flops": flops,
            "compute_s": compute_s, "flops": flops / compute_s}


def _side_by_side(ranks: int, shape: dict) -> dict:
    """[Note: the compute rate of ranks side by side]
    Ranks that share this machine's cores each get ``1 / ranks`` of the machine's rates ([Note: a rank's share
    of the machine] in engine/hwprofile.py). For the compute that share depends on the model: a small model's
    kernels use two cores poorly, so one core does more than half their work. Measured on 2 cores, a rank of
    two computed gpt-tiny (batch 8 x 128) in 1.46x the time of one process on both cores and gpt-small (4 x
    256) in 1.91x, where dividing the rate by 2 had overpredicted gpt-tiny's 2-rank steps by 24-36%. So
    for ranks on the CPU the rate is measured by the ranks themselves: ``ranks`` processes, each pinned to its
    share of the cores as a launched rank is (``pin_cores``), run the probe at once, and the rate taken is a
    rank's (their median) times ``ranks``: a profile's ``compute_flops`` stays the machine's, which
    ``per_rank`` divides back into the rate a rank measured."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter per rank: pinned before torch starts threads
    barrier, results = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=_rank_probe, args=(r, ranks, shape, barrier, results), daemon=True)
             for r in range(ranks)]
    for p in procs:
        p.start()
    got: list[dict] = []
    try:
        while len(got) < ranks:
            try:
                got.append(results.get(timeout=1.0))
            except queue.Empty:
                dead = next((p for p in procs if p.exitcode not in (None, 0)), None)
                if dead is not None:
                    raise RuntimeError(f"a compute probe rank died (exit code {dead.exitcode})") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    failed = [g for g in got if "error" in g]
    if failed:
        raise RuntimeError(f"compute probe of rank {failed[0]['rank']} of {ranks} failed: {failed[0]['error']}")
    per_rank = statistics.median(g["flops"] for g in got)
    return {**{k: v for k, v in shape.items() if k != "keep_graphs"}, "ranks": ranks,
            "step_flops": got[0]["step_flops"], "compute_s": statistics.median(g["compute_s"] for g in got),
            "rank_flops": [g["flops"] for g in sorted(got, key=lambda g: g["rank"])], "flops": per_rank * ranks}


def _rank_probe(rank: int, ranks: int, shape: dict, barrier: Any, results: Any) -> None:
    """One rank of ``_side_by_side``: pinned to its cores, timed once every rank is set up."""
    try:
        from luwu_rt.dist.launch import pin_cores

        pin_cores(rank, ranks)
        results.put({"rank": rank, **compute_rate(**shape, start=barrier.wait)})
    except BaseException as exc:  # the parent reports it; a rank that failed must not leave the others waiting
        barrier.abort()
        results.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})


def overlap(*, seconds: float = 0.3, device: str = "cpu", rounds: int = 3) -> dict:
    """[Note: shared cores] in plan/cost.py: a matmul, the fused optimizer and a copy, each sized to take about
    ``seconds`` alone, then all three at once on threads (each releases the GIL). ``cpu_overlap`` is the share
    of the work beyond the longest that the concurrent run hid: 1 when together took as long as the longest
    alone, 0 when it took their sum."""
    import torch

    from luwu_rt.kernels import adamw_step

    n = 512
    a, b = torch.rand(n, n, device=device), torch.rand(n, n, device=device)
    p, g, m, v = (torch.rand(1 << 21) for _ in range(4))
    src = torch.empty(32 << 20, dtype=torch.uint8)
    dst = torch.empty(32 << 20, dtype=torch.uint8, device=device)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    unit = {"compute": lambda: (torch.mm(a, b), sync()), "optim": lambda: adamw_step(p, g, m, v, step=1, lr=1e-3),
            "copy": lambda: (dst.copy_(src), sync())}
    reps = {}
    for name, fn in unit.items():
        one = _median_time(fn, repeats=3)
        reps[name] = max(1, int(seconds / one))

    def loop(name: str) -> Callable[[], None]:
        return lambda: [unit[name]() for _ in range(reps[name])]

    def together() -> float:
        threads = [threading.Thread(target=loop(name)) for name in unit]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - start

    # Interleaved rounds: drift from other processes hits the runs alone and together alike.
    runs: dict[str, list[float]] = {name: [] for name in (*unit, "together")}
    for _ in range(rounds):
        for name in unit:
            start = time.perf_counter()
            loop(name)()
            runs[name].append(time.perf_counter() - start)
        runs["together"].append(together())
    alone = {name: statistics.median(runs[name]) for name in unit}
    both = statistics.median(runs["together"])
    total, longest = sum(alone.values()), max(alone.values())
    share = (total - both) / (total - longest) if total > longest else 1.0
    return {"alone_s": alone, "together_s": both, "cpu_overlap": min(max(share, 0.0), 1.0)}


# -- the network: gloo collectives and the node protocol --------------------------------------------

def _collective_rank(rank: int, port: int, mib: int, out) -> None:
    """One of two local ranks: each pinned to its share of the cores as a run's ranks are."""
    import torch
    import torch.distributed as dist

    from luwu_rt.dist.collectives import TorchGroup
    from luwu_rt.dist.launch import pin_cores

    pin_cores(rank, 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    small, big = torch.zeros(2), torch.zeros(mib << 18)  # 8 bytes; mib MiB of fp32
    half = torch.zeros(big.numel() // 2)
    group = TorchGroup(None)  # the reduce-scatter and all-gather as a run issues them ([Note: collectives on gloo])

    def timed(fn: Callable[[], Any], repeats: int) -> float:
        fn()
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    result = {"all_reduce_small_s": timed(lambda: dist.all_reduce(small), 50),
              "all_reduce_s": timed(lambda: dist.all_reduce(big), 5),
              "reduce_scatter_s": timed(lambda: group.reduce_scatter(half, list(big.chunk(2))).wait(), 5),
              "all_gather_s": timed(lambda: group.all_gather(list(big.chunk(2)), half).wait(), 5)}
    dist.destroy_process_group()
    if rank == 0:
        out.put(result)


def collectives(*, mib: int = 16, timeout_s: float = 120.0) -> dict:
    """gloo between two local processes: the latency of an 8-byte all-reduce and the bandwidth of an ``mib``
    MiB one, read as the cost model's alpha and beta ([Note: collective cost] in plan/cost.py); the
    reduce-scatter and all-gather of the same buffer beside them, each as the bandwidth its model implies."""
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_collective_rank, args=(r, port, mib, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        r = out.get(timeout=timeout_s)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    nbytes = mib << 20
    alpha = r["all_reduce_small_s"] / 2  # 2 (p - 1) message steps, p = 2
    # p = 2: all-reduce moves M (2 (p-1)/p M), reduce-scatter and all-gather M / 2 each, after their latencies.
    algbw = {"all_reduce": nbytes / max(r["all_reduce_s"] - 2 * alpha, 1e-9) / _GB,
             "reduce_scatter": nbytes / 2 / max(r["reduce_scatter_s"] - alpha, 1e-9) / _GB,
             "all_gather": nbytes / 2 / max(r["all_gather_s"] - alpha, 1e-9) / _GB}
    return {"latency_s": alpha, "gbps": algbw, "times_s": r, "mib": mib}


def collective_keys(coll: dict) -> dict[str, float]:
    """The profile's figures of the network between ranks from a ``collectives`` result: one machine's ranks talk
    over one loopback, inside a sharding group as between all ranks."""
    net_gbps = coll["gbps"]["all_reduce"]
    return {"net_gbps": net_gbps, "net_latency_s": coll["latency_s"],
            "group_gbps": net_gbps, "group_latency_s": coll["latency_s"],
            "shard_collective_factor": max(1.0, net_gbps * (1 / coll["gbps"]["reduce_scatter"]
                                                            + 1 / coll["gbps"]["all_gather"]) / 2)}


def zmq_protocol_gbps(*, total: int = 64 << 20, chunk: int = 4 << 20, repeats: int = 3) -> float:
    """The node protocol's push+pull payload GB/s over TCP loopback: a worker pushes ``total`` bytes in
    ``chunk``-byte PUSH_GRAD messages, each decoded (CRC-32C checked) and acknowledged by a ROUTER on a thread,
    then pulls them back as PARAM messages."""
    import numpy as np
    import zmq

    from luwu_rt.node.protocol import DTYPE_CODES, Message, T, decode, encode

    ctx = zmq.Context.instance()
    server = ctx.socket(zmq.ROUTER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client = ctx.socket(zmq.DEALER)
    client.connect(f"tcp://127.0.0.1:{port}")
    store = np.zeros(total, dtype=np.uint8)
    n = -(-total // chunk)

    def serve() -> None:
        view = memoryview(store)
        while True:
            ident, *body = server.recv_multipart(copy=False)
            msg = decode(body)
            if msg.type == T.HEARTBEAT:
                return
            if msg.type == T.PUSH_GRAD:
                store[msg.offset:msg.offset + msg.nbytes] = np.frombuffer(msg.payload, np.uint8)
                server.send_multipart([ident, *encode(Message(T.ACK, offset=msg.offset))])
            else:
                for off in range(0, total, chunk):
                    server.send_multipart([ident, *encode(Message(T.PARAM, offset=off, dtype=DTYPE_CODES["float32"],
                                                                  payload=view[off:off + chunk]))], copy=False)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    data = np.random.default_rng(0).integers(0, 255, total, dtype=np.uint8)
    back = np.zeros_like(data)
    view = memoryview(data)

    def round_trip() -> None:
        for i, off in enumerate(range(0, total, chunk)):
            client.send_multipart(encode(Message(T.PUSH_GRAD, step=1, chunk=i, offset=off,
                                                 dtype=DTYPE_CODES["float32"], payload=view[off:off + chunk])),
                                  copy=False)
        for _ in range(n):
            decode(client.recv_multipart(copy=False))
        client.send_multipart(encode(Message(T.PULL_PARAM, step=1)))
        for _ in range(n):
            msg = decode(client.recv_multipart(copy=False))
            back[msg.offset:msg.offset + msg.nbytes] = np.frombuffer(msg.payload, np.uint8)

    try:
        seconds = _median_time(round_trip, repeats=repeats)
        assert np.array_equal(back, data), "the node protocol probe read back other bytes than it pushed"
    finally:
        client.send_multipart(encode(Message(T.HEARTBEAT)))
        thread.join(timeout=10)
        client.close(0)
        server.close(0)
    return 2 * total / seconds / _GB


def zmq_latency_s(*, count: int = 1000) -> float:
    """Half a ZeroMQ round trip of a 56-byte message (a header) over TCP loopback, seconds."""
    import zmq

    ctx = zmq.Context.instance()
    server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client.connect(f"tcp://127.0.0.1:{port}")

    def echo() -> None:
        for _ in range(count + 1):
            server.send_multipart(server.recv_multipart())

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    try:
        client.send(b"x" * 56)
        client.recv()
        start = time.perf_counter()
        for _ in range(count):
            client.send(b"x" * 56)
            client.recv()
        took = time.perf_counter() - start
    finally:
        thread.join(timeout=10)
        client.close(0)
        server.close(0)
    return took / count / 2
