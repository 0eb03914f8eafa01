"""Tiny Hugging Face models saved with ``save_pretrained`` (safetensors, several shards) to a temporary folder."""

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers comes with the test extra")

VOCAB = 256  # byte-level training data


def gpt2_config():
    return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0,
                                   eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def llama_config():
    return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                                    bos_token_id=0, eos_token_id=0)


CONFIGS = {"gpt2": gpt2_config, "llama": llama_config}


def save_tiny(name: str, folder, *, seed: int = 11):
    """A model with seeded weights (not the luwu seed's), saved in shards of ~40 KB; returns the model."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="sdpa")
    model.save_pretrained(folder, max_shard_size="40KB")
    return model


@pytest.fixture(scope="session", params=list(CONFIGS))
def saved(request, tmp_path_factory):
    """``(name, folder, model)`` for each family."""
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, save_tiny(request.param, folder)


def save_tokenizer(folder, docs):
    """A word-level tokenizer trained on ``docs`` (nothing downloaded), saved as ``folder/tokenizer.json``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(docs, trainers.WordLevelTrainer(special_tokens=["<unk>", "<|endoftext|>"]))
    tok.save(str(folder / "tokenizer.json"))
    return tok
