"""``luwu train --model hf:DIR`` against a plain Hugging Face + ``torch.optim.AdamW`` loop from the same weights."""

import json
import subprocess
import sys

import pytest
import torch

from luwu_rt.data import BatchSampler, DataConfig, load_tokens
from luwu_rt.engine import TrainConfig
from luwu_rt.optim.schedule import lr_at

from .conftest import VOCAB, transformers

STEPS, BATCH, SEQ = 10, 4, 32


def _data(tmp_path):
    path = tmp_path / "text.txt"
    # Any bytes will do; a repeated source file gives the model something to learn within ten steps.
    path.write_bytes((open(transformers.__file__, "rb").read() * 8)[:64 << 10])
    return path


def _reference_losses(folder, data) -> list[float]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
    model.train()
    o = TrainConfig().optim  # the defaults the CLI run uses
    opt = torch.optim.AdamW(model.parameters(), lr=1.0, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay)
    sampler = BatchSampler(load_tokens(DataConfig(path=str(data)), vocab_size=VOCAB).train, batch_size=BATCH,
                           seq_len=SEQ, seed=0, vocab_size=VOCAB)
    losses = []
    for step in range(1, STEPS + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps, total_steps=STEPS)
        x, y = sampler.batch(step - 1)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        losses.append(loss.item())
    return losses


def _flags(folder, data, log, tmp_path, tier) -> list[str]:
    return [f"--model=hf:{folder}", f"--data={data}", f"--steps={STEPS}", f"--batch-size={BATCH}",
            f"--seq-len={SEQ}", "--eval-every=0", f"--json-log={log}", "--quiet", f"--offload-params={tier}",
            f"--offload-optimizer={tier}", f"--offload-grads={tier}", f"--nvme-dir={tmp_path / 'nvme'}",
            "--device-mem=64MiB", "--host-mem=64MiB", "--chunk-size=64KiB"]


# Each family runs once through the CLI (a fresh process: ~10 s of importing transformers on a small machine)
# and once in-process through the same flags, so that both tiers are covered for both.
CLI_TIER = {"gpt2": "host", "llama": "nvme"}


@pytest.mark.parametrize("via", ["cli", "engine"])
def test_fine_tune_matches_plain_hf_loop(saved, tmp_path, via) -> None:
    name, folder, _model = saved
    data, log = _data(tmp_path), tmp_path / "log.jsonl"
    tier = CLI_TIER[name] if via == "cli" else {"host": "nvme", "nvme": "host"}[CLI_TIER[name]]
    flags = _flags(folder, data, log, tmp_path, tier)
    if via == "cli":
        run = subprocess.run([sys.executable, "-m", "luwu_rt", "train", *flags], capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        assert f"first weights from {folder} (" in run.stderr
    else:
        import argparse

        from luwu_rt.cli import train

        parser = argparse.ArgumentParser()
        train.add_arguments(parser)
        assert train.run(parser.parse_args(flags)) == 0
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    assert losses == pytest.approx(_reference_losses(folder, data), rel=1e-5)


def test_hf_model_trains_on_jsonl_with_its_own_tokenizer(tmp_path) -> None:
    from luwu_rt.config import from_mapping
    from luwu_rt.engine import Engine

    from .conftest import save_tiny, save_tokenizer

    docs = ["the cat sat on the mat", "a dog ran in the park"] * 20
    save_tiny("gpt2", tmp_path / "model")
    save_tokenizer(tmp_path / "model", docs)
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    config = from_mapping(TrainConfig, {
        "model": f"hf:{tmp_path / 'model'}", "steps": 2, "batch_size": 2, "seq_len": 8,
        "data": {"path": str(data)},
        "offload": {"params": "host", "optimizer": "host", "grads": "host", "device_mem": "64MiB",
                    "host_mem": "64MiB", "chunk_size": "64KiB"}})
    with Engine(None, config) as engine:
        losses = [engine.train_step()["loss"] for _ in range(2)]
        assert f"tokenized with {tmp_path / 'model'}" in engine.tokens.source
    assert all(loss == loss for loss in losses)  # finite: ids within the model's vocabulary
