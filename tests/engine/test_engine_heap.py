"""An engine leaves no freed heap resident after materialising its model, and its threads allocate from one heap
([Note: the C heap under CPU tensors] in luwu_rt/heap.py). Measured in a fresh interpreter: the test process's
own heap has a history of its own."""

import ctypes
import json
import subprocess
import sys

import pytest

_GLIBC = all(hasattr(ctypes.CDLL(None), f) for f in ("malloc_trim", "mallopt", "malloc_info"))

_SCRIPT = r"""
import ctypes, json, os, tempfile
import torch
from luwu_rt.config import from_mapping
from luwu_rt.engine import Engine, TrainConfig
from luwu_rt.models.presets import GPTShape

libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def arenas() -> int:
    path = tempfile.mktemp()
    f = libc.fopen(path.encode(), b"w")
    libc.malloc_info(0, f)
    libc.fclose(f)
    with open(path) as text:
        count = text.read().count("<heap nr=")
    os.unlink(path)
    return count


# Four blocks of 3.1M parameters: each unit's temporaries (12.6 MB apiece) are freed one unit at a time.
shape = GPTShape(name="heap-test", num_layers=4, d_model=512, num_heads=8, vocab_size=256, max_seq_len=64)
config = from_mapping(TrainConfig, {"batch_size": 2, "seq_len": 32, "dtype": "fp32", "steps": 2, "offload": {
    "params": "device", "optimizer": "device", "grads": "device", "device_mem": "1GiB", "host_mem": "64MiB"}})
engine = Engine(shape, config)
before = rss()
libc.malloc_trim(0)
kept = before - rss()
engine.train_step()
engine.queues.drain()
print(json.dumps({"kept_free_bytes": kept, "arenas": arenas()}))
engine.close()
"""


@pytest.mark.skipif(not _GLIBC, reason="malloc_trim, mallopt and malloc_info are glibc's")
def test_materialising_leaves_no_freed_heap_and_the_step_s_threads_share_one_heap() -> None:
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # Without the engine's trim the units' temporaries stayed: a trim here gave back 88 MiB.
    assert got["kept_free_bytes"] < 16 << 20, got
    # Without one arena the compute and memory queue threads each made one of their own: 4 in all.
    assert got["arenas"] == 1, got
