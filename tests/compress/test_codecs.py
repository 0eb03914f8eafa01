"""The gradient codecs: payload sizes as [Note: codecs on the wire] states them, round trips, the Numba kernels
against the plain torch definitions (byte for byte), and error feedback keeping the accumulated error
bounded over many steps (a property, for every codec)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from luwu_rt.compress import codec_for, torch_codecs
from luwu_rt.plan.codec import parse_codec, parse_request

CODECS = ["bf16", "fp16", "onebit", "topk:0.01", "topk:0.25", "powersgd:1", "powersgd:4"]
CHUNK = 1024


def _gradient(n: int, seed: int, *, ties: bool = True) -> torch.Tensor:
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    if ties and n > 7:
        g[::7] = g[1]  # equal magnitudes: topk's tie rule, onebit's signs of equal values
        g[3::11] = -g[1]
    return g


def _encode(codec, g: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    payload = torch.empty(codec.payload_bytes(g.numel()), dtype=torch.uint8)
    codec.encode(g, e, payload)
    return payload


@pytest.mark.parametrize("name", CODECS)
def test_payload_sizes_follow_the_formula(name) -> None:
    spec = parse_codec(name)
    formula = {"bf16": lambda n: 4 * math.ceil(n / 2), "fp16": lambda n: 4 * math.ceil(n / 2),
               "onebit": lambda n: 4 + 4 * math.ceil(n / 32),
               "topk": lambda n: 8 * min(n, max(1, math.ceil(spec.ratio * n))),
               "powersgd": lambda n: 4 * min(spec.rank, math.ceil(n / math.ceil(math.sqrt(n))), math.ceil(math.sqrt(n)))
               * (math.ceil(n / math.ceil(math.sqrt(n))) + math.ceil(math.sqrt(n)))}[spec.family]
    for n in (1, 2, 31, 32, 33, 100, 1000, 1024):
        assert spec.chunk_bytes(n) == formula(n), (name, n)
        assert spec.chunk_bytes(n) % 4 == 0
    block = spec.codec_chunk(CHUNK)  # onebit: its scale block
    assert block == (128 if spec.family == "onebit" else CHUNK)
    assert spec.payload_bytes(2500, CHUNK) == 2500 // block * formula(block) + formula(2500 % block)
    assert spec.payload_bytes(0, CHUNK) == 0


def test_onebit_and_topk_cut_the_bytes_as_advertised() -> None:
    n = 1 << 20
    assert 4 * n / parse_codec("onebit").payload_bytes(n, CHUNK) == 25.6  # 20 bytes per 128 elements
    assert 4 * n / parse_codec("topk:0.01").payload_bytes(n, CHUNK) > 45
    assert 4 * n / parse_codec("bf16").payload_bytes(n, CHUNK) == 2


@pytest.mark.parametrize("text", ["zip", "topk", "topk:0", "topk:1.5", "topk:x", "powersgd", "powersgd:0",
                                  "onebit:3", "auto:", "auto:zip"])
def test_bad_codec_names_are_refused_naming_the_flag(text) -> None:
    with pytest.raises(ValueError, match="--compress"):
        parse_request(text)


def test_requests() -> None:
    assert parse_request("onebit") == (False, ("onebit",))
    assert parse_request("topk:0.010") == (False, ("topk:0.01",))
    assert parse_request("auto") == (True, ("bf16", "onebit"))
    assert parse_request("auto:none,topk:0.1,powersgd:2") == (True, ("topk:0.1", "powersgd:2"))


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("n", [1, 31, 1024, 2500])
def test_kernels_equal_the_torch_definition(name, n) -> None:
    """On the CPU the Numba kernels (powersgd: torch itself) run; the plain torch definition is what a GPU runs.
    Same payload bytes, residual and decoded values, also when decoding adds into what the output holds."""
    codec = codec_for(name, chunk_numel=CHUNK)
    g, e0 = _gradient(n, 1), _gradient(n, 2, ties=False) * 0.1
    e1, e2 = e0.clone(), e0.clone()
    p1 = _encode(codec, g, e1)
    p2 = torch.empty_like(p1)
    torch_codecs.encode(codec.spec, g, e2, p2, chunk=codec.chunk)
    assert torch.equal(p1, p2) and torch.equal(e1, e2)
    for accumulate in (False, True):
        d1, d2 = g.clone(), g.clone()
        codec.decode(p1, d1, accumulate=accumulate)
        torch_codecs.decode(codec.spec, p2, d2, chunk=codec.chunk, accumulate=accumulate)
        assert torch.equal(d1, d2), accumulate


@pytest.mark.parametrize("name", CODECS)
def test_round_trip_leaves_the_error_in_the_residual(name) -> None:
    """decode(encode(x)) + residual = x, with x = gradient + the residual before."""
    codec = codec_for(name, chunk_numel=CHUNK)
    g, e = _gradient(3000, 3), _gradient(3000, 4) * 0.01
    x = g + e
    decoded = torch.empty(3000)
    codec.decode(_encode(codec, g, e), decoded)
    torch.testing.assert_close(decoded + e, x, rtol=0, atol=1e-6)
    assert e.abs().sum() > 0 or name in ("bf16", "fp16")


@pytest.mark.parametrize("name,x", [
    ("bf16", torch.tensor([1.5, -2.0, 0.0, 2.0 ** -100, 3.0 * 2 ** 20] * 9)),
    ("fp16", torch.tensor([1.5, -2.0, 0.0, 2.0 ** -14, 65504.0] * 9)),
    ("onebit", torch.tensor([0.25, -0.25] * 40)),
    ("topk:1", torch.randn(2500)),
    ("powersgd:64", torch.randn(2500)),
])
def test_lossless_cases_come_back_whole(name, x) -> None:
    """What a codec can represent survives a round trip and leaves no residual: values exact in bf16/fp16,
    one magnitude for onebit, every value for topk:1, a rank at least the chunk's for powersgd."""
    codec = codec_for(name, chunk_numel=CHUNK)
    e = torch.zeros_like(x)
    out = torch.empty_like(x)
    codec.decode(_encode(codec, x, e), out)
    if name.startswith("powersgd"):
        torch.testing.assert_close(out, x, rtol=1e-4, atol=1e-4)
    else:
        assert torch.equal(out, x) and not e.any()


def test_topk_keeps_the_largest_and_the_lowest_index_among_ties() -> None:
    codec = codec_for("topk:0.25", chunk_numel=32)
    x = torch.zeros(8)
    x[[1, 2, 5, 6]] = torch.tensor([3.0, -1.0, -3.0, 1.0])  # k = 2: the two 3s; then ties at 1 by index
    out = torch.empty(8)
    codec.decode(_encode(codec, x, torch.zeros(8)), out)
    assert out.tolist() == [0, 3, 0, 0, 0, -3, 0, 0]
    codec = codec_for("topk:0.375", chunk_numel=32)  # k = 3: the 3s and the first of the 1s
    codec.decode(_encode(codec, x, torch.zeros(8)), out)
    assert out.tolist() == [0, 3, -1, 0, 0, -3, 0, 0]


def test_a_gradient_that_overflowed_does_not_poison_the_residual() -> None:
    for name in ("bf16", "onebit", "topk:0.25"):
        codec = codec_for(name, chunk_numel=32)
        g = torch.ones(64)
        g[5] = math.inf
        g[40] = math.nan
        e = torch.zeros(64)
        _encode(codec, g, e)
        assert torch.isfinite(e).all(), name


# -- error feedback: the accumulated error stays bounded ---------------------------------------------------

def _contraction(name: str, n: int, chunk: int) -> float:
    """sqrt(1 - delta): what one encode leaves of |x| at most, per chunk (casts: per element)."""
    spec = parse_codec(name)
    if spec.family == "bf16":
        return 2.0 ** -8
    if spec.family == "fp16":
        return 2.0 ** -11
    if spec.family == "onebit":  # |x - mean|x| sign x|^2 = |x|^2 - n mean|x|^2 <= (1 - 1/n) |x|^2
        return math.sqrt(1 - 1 / min(n, chunk))
    if spec.family == "topk":  # the k largest of n carry at least k/n of |x|^2
        return max(math.sqrt(1 - spec.topk_count(c) / c) for c in {min(n, chunk), n % chunk or chunk})
    return 1.0  # powersgd projects: it never grows |x|, nor does it guarantee to shrink it


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["bf16", "fp16", "onebit", "topk:0.1", "topk:0.5", "powersgd:1", "powersgd:2"]),
       n=st.integers(1, 200), steps=st.integers(20, 300), seed=st.integers(0, 2**31 - 1),
       kind=st.sampled_from(["normal", "same", "spiky", "drifting"]))
def test_error_feedback_keeps_the_accumulated_error_bounded(name, n, steps, seed, kind) -> None:
    """Over many steps, what the codec delivered plus the final residual is what the gradients summed to
    (nothing lost, nothing invented), and the residual stays bounded by a constant times the largest
    gradient, however many steps ran: for a codec that keeps at least delta of every |x|^2, by
    sqrt(1 - delta) / (1 - sqrt(1 - delta)) (e_{t+1} = x_t - D(C(x_t)), x_t = g_t + e_t)."""
    chunk = 32
    codec = codec_for(name, chunk_numel=chunk)
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=gen)
    e = torch.zeros(n, dtype=torch.float32)
    sent = torch.zeros(n, dtype=torch.float64)
    total = torch.zeros(n, dtype=torch.float64)
    largest = 0.0
    out = torch.empty(n)
    for t in range(steps):
        if kind == "same":
            g = base.clone()
        elif kind == "drifting":
            g = base + 0.01 * t * torch.randn(n, generator=gen)
        else:
            g = torch.randn(n, generator=gen) * ({"normal": 1.0}.get(kind) or (100.0 if t % 17 == 0 else 0.01))
        largest = max(largest, float(g.norm()))
        total += g.double()
        codec.decode(_encode(codec, g, e), out)
        sent += out.double()
        assert torch.isfinite(e).all()
    scale = float(total.abs().max()) + largest * steps
    torch.testing.assert_close(sent + e.double(), total, rtol=0, atol=1e-5 * scale)
    shrink = _contraction(name, n, chunk)
    # powersgd guarantees no contraction; error feedback still keeps it bounded in practice (sqrt(n) x as loose).
    bound = shrink / (1 - shrink) if shrink < 1 else 4 * math.sqrt(n) + 4
    assert float(e.norm()) <= bound * largest * (1 + 1e-4) + 1e-6, (float(e.norm()), bound, largest)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the codecs' GPU path runs on CUDA tensors: needs a GPU")
@pytest.mark.parametrize("name", CODECS)
def test_the_gpu_path_equals_the_cpu_kernels(name) -> None:
    """On a GPU the codecs run their torch definition on CUDA tensors: the same payloads (powersgd: within
    the rounding of another BLAS) and the same decoded values as the CPU kernels."""
    codec = codec_for(name, chunk_numel=CHUNK)
    g, e0 = _gradient(2500, 5), _gradient(2500, 6, ties=False) * 0.1
    e_cpu, e_gpu = e0.clone(), e0.cuda()
    p_cpu = _encode(codec, g, e_cpu)
    p_gpu = torch.empty(p_cpu.numel(), dtype=torch.uint8, device="cuda")
    codec.encode(g.cuda(), e_gpu, p_gpu)
    out_cpu, out_gpu = torch.ones(2500), torch.ones(2500, device="cuda")
    codec.decode(p_cpu, out_cpu, accumulate=True)
    codec.decode(p_gpu, out_gpu, accumulate=True)
    if name.startswith("powersgd"):
        torch.testing.assert_close(out_gpu.cpu(), out_cpu, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(e_gpu.cpu(), e_cpu, rtol=1e-4, atol=1e-5)
    else:
        assert torch.equal(p_gpu.cpu(), p_cpu) and torch.equal(e_gpu.cpu(), e_cpu)
        assert torch.equal(out_gpu.cpu(), out_cpu)
