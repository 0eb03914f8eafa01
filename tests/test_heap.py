"""luwu_rt.heap: one arena unless the user chose, trimming is safe to call any time."""

import subprocess
import sys

from luwu_rt import heap

_ARENAS_AFTER_THREADS = r"""
import ctypes, os, sys, tempfile, threading
from luwu_rt import heap
print(heap.share_one_arena())
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def work():
    libc.free(libc.malloc(1 << 20))

threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
path = tempfile.mktemp()
f = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, f)
libc.fclose(f)
print(open(path).read().count("<heap nr="))
"""


def _run(env_extra: dict) -> tuple[str, int]:
    import os

    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"} | env_extra
    out = subprocess.run([sys.executable, "-c", _ARENAS_AFTER_THREADS], capture_output=True, text=True, env=env,
                         timeout=120, check=True)
    set_, arenas = out.stdout.split()
    return set_, int(arenas)


def test_threads_share_one_arena_unless_the_user_set_malloc_arena_max() -> None:
    if not hasattr(heap, "_libc") or heap._libc() is None:
        return  # not glibc: both calls do nothing (checked below)
    assert _run({}) == ("True", 1)
    set_, arenas = _run({"MALLOC_ARENA_MAX": "8"})
    assert set_ == "False" and arenas > 1  # the user's choice stands (and the count above is no accident)


def test_trim_is_safe_at_any_time() -> None:
    assert heap.trim() in (True, False)
