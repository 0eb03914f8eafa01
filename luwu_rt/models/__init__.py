"""Models as chains of units.

- ``presets``: GPT shapes from gpt-tiny to gpt-175b (pure Python, no torch);
- ``units``: ``UnitChain``, the interface the engine trains through, and the
  ``nn.Sequential`` adapter;
- ``gpt``: the built-in GPT family, built on meta, materialised per unit;
- ``hf``: Hugging Face GPT-2 and Llama-family adapters (needs ``transformers``);
- ``adapt``: ``as_unit_chain``, from any of the above (or ``"hf:PATH"``) to a chain;
- ``weights``: where a run's first weights come from (a checkpoint, the model's own tensors, the seed);
- ``safetensors_in``: a safetensors checkpoint streamed in unit by unit, checked by name and shape.

Nothing is imported here, so that ``luwu plan`` can read the presets without
loading torch.
"""
