"""Streaming a checkpoint in never holds the whole model: anonymous memory while loading a model several times
larger than the host budget stays within the budgets plus a few units ([Note: streaming a checkpoint in]).

The loading is measured in a process of its own, on its second load, with glibc's mmap threshold fixed. In the
test run's process, after a thousand other tests, the allocator's history added up to 33 MiB (glibc raises the
threshold each time a large block is freed, and blocks below it come from heaps that are not given back), and
a first load also counts the modules it imports and the caches it fills (about 90 MiB): both are the process's,
not the loader's. With the threshold fixed every large block is mapped and unmapped, so the growth is the
memory the loader holds."""

import ctypes
import gc
import multiprocessing
import threading

import torch

from luwu_rt.config import from_mapping
from luwu_rt.engine import Engine, TrainConfig
from luwu_rt.plan import parse_size

from .conftest import transformers

MiB = 1 << 20


def _rss_anon() -> int:
    # RssAnon, not VmRSS: the mapped safetensors files are file-backed pages the kernel may drop.
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


class _Peak:
    """The largest RssAnon seen by a thread polling while the block runs."""

    def __enter__(self):
        self.peak, self._stop = _rss_anon(), threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss_anon())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_anon())


def _loading_growth(config: TrainConfig) -> int:
    """The peak growth of anonymous memory while an engine loads the model a second time in this process."""
    M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter; setting it also stops the threshold from moving
    assert ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 * 1024) == 1, "mallopt refused the threshold"
    Engine(None, config).close()  # the imports and caches of a first load
    gc.collect()
    with _Peak() as peak:
        baseline = _rss_anon()
        engine = Engine(None, config)
    engine.close()
    return peak.peak - baseline


def test_loading_stays_within_budget_plus_a_few_units(tmp_path) -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=24, hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(tmp_path / "model", max_shard_size="8MB")
    model_bytes = sum(p.numel() for p in model.parameters()) * 4
    unit_bytes = max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers) * 4
    del model
    host, device = "20MiB", "16MiB"
    config = from_mapping(TrainConfig, {
        "model": f"hf:{tmp_path / 'model'}", "steps": 1, "batch_size": 1, "seq_len": 8, "keep_graphs": "none",
        "offload": {"params": "nvme", "optimizer": "nvme", "grads": "nvme", "device_mem": device, "host_mem": host,
                    "chunk_size": "256KiB", "nvme_dir": str(tmp_path / "nvme")}})
    budgets = parse_size(host) + parse_size(device)
    assert model_bytes > 4 * parse_size(host) and model_bytes > 2 * budgets  # the premise: the model does not fit
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        grew = pool.apply(_loading_growth, (config,))
    # master + two zero moments of one unit, one tensor being converted, and slack for IO buffers and the allocator.
    bound = budgets + 4 * unit_bytes + 16 * MiB
    assert grew < bound, f"loading grew anonymous memory by {grew / MiB:.0f} MiB; bound {bound / MiB:.0f} MiB"
    assert grew < model_bytes
