"""The one dtype table ([Note: dtype names] in plan/dtypes.py): its names are torch's, its sizes torch's, and
the planner's shard sizes agree with the types the executor's handlers view the shards as."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from luwu_rt.exec import state_dtypes
from luwu_rt.kernels.dtypes import COMPUTE_DTYPES, LOW_PRECISION_DTYPES, TORCH_DTYPES, torch_dtype
from luwu_rt.plan import Budgets, ModelSpec, Placement, Strategy, UnitSpec, plan_node, plan_step
from luwu_rt.plan.dtypes import DTYPE_NAMES, ELEMENT_BYTES, FIXED_STATE_DTYPES, LOW_PRECISION
from luwu_rt.plan.sequence import element_bytes
from luwu_rt.plan.spec import STRATEGIES


def test_the_names_and_sizes_are_torchs() -> None:
    for name, size in ELEMENT_BYTES.items():
        assert TORCH_DTYPES[name] is getattr(torch, name) and TORCH_DTYPES[name].itemsize == size
    assert list(COMPUTE_DTYPES) == list(DTYPE_NAMES) == ["fp32", "bf16", "fp16"]
    assert COMPUTE_DTYPES == {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    assert LOW_PRECISION_DTYPES == (torch.bfloat16, torch.float16) and set(LOW_PRECISION) < set(DTYPE_NAMES)
    assert set(FIXED_STATE_DTYPES.values()) <= set(ELEMENT_BYTES)


def test_torch_dtype_takes_either_name_and_refuses_others_naming_the_flag() -> None:
    assert torch_dtype("bf16") is torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match=r"--dtype 'float64': choose one of fp32, bf16, fp16"):
        torch_dtype("float64", what="--dtype")  # a table dtype, but not one the runtime computes in


@pytest.mark.parametrize("dtype", list(DTYPE_NAMES))
def test_the_planner_sizes_every_shard_as_the_handlers_view_it(dtype: str) -> None:
    """Every shard kind of every strategy's plan (and the node's): the bytes per element the planner sized it
    with are the element size of the type ``state_dtypes`` gives the handlers."""
    param = COMPUTE_DTYPES[dtype]
    units = tuple(UnitSpec(name=f"u{i}", num_params=n, flops_per_token=2 * n) for i, n in enumerate((3000, 5000)))
    roomy, home = Budgets(device_bytes=1 << 30, host_bytes=1 << 30), Placement(params="host", optimizer="host",
                                                                              grads="host")
    for grad in (param, torch.float32):  # ranks reduce gradients in fp32 ([Note: data parallelism in the engine])
        model = ModelSpec(units=units, param_bytes=param.itemsize, grad_bytes=grad.itemsize, chunk_bytes=8192,
                          tokens_per_step=4, optimizer_waits_for_backward=True)
        views = state_dtypes(param_dtype=param, grad_dtype=grad)
        plans = [(plan_step(model, budgets=roomy, placement=home,
                            strategy=Strategy(name=name, world_size=1 if name == "local" else 2,
                                              group_size=2 if name == "hsdp" else 0)), model, views)
                 for name in STRATEGIES]
        # The node sums the pushes in fp32 whatever the workers compute in (plan/node.py).
        plans.append((plan_node(model, budgets=Budgets(device_bytes=0, host_bytes=1 << 30), placement=home,
                                num_workers=2), replace(model, grad_bytes=4),
                      state_dtypes(param_dtype=param, grad_dtype=torch.float32)))
        kinds = {sid.state for plan, _, _ in plans for sid in plan.shards}
        assert kinds <= set(views) and {"norm", "master", "param_full", "grad_slice"} <= kinds
        for plan, planned, dtypes in plans:
            for sid, info in plan.shards.items():
                assert element_bytes(planned, sid.state) == dtypes[sid.state].itemsize, (plan.strategy, sid)
                assert info.numel * dtypes[sid.state].itemsize <= info.nbytes, (plan.strategy, sid)
