"""Drop-in torch.optim optimizers on luwu_rt's fused kernels."""

from luwu_rt.optim.fused import SGD, Adam, AdamW

__all__ = ["SGD", "Adam", "AdamW"]
