"""Training data: the embedded default corpus, user token files, and a seeded batch sampler."""

from luwu_rt.data.corpus import DEFAULT_CORPUS_BYTES, stdlib_corpus
from luwu_rt.data.sampler import BatchSampler
from luwu_rt.data.tokens import DataConfig, TokenData, load_tokens

__all__ = ["DEFAULT_CORPUS_BYTES", "BatchSampler", "DataConfig", "TokenData", "load_tokens", "stdlib_corpus"]
