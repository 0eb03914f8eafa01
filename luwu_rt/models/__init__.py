"""Models as chains of units.

- ``presets``: GPT shapes from gpt-tiny to gpt-175b (pure Python, no torch);
- ``units``: ``UnitChain``, the interface the engine trains through, and the
  ``nn.Sequential`` adapter;
- ``gpt``: the built-in GPT family, built on meta, materialised per unit;
- ``hf``: Hugging Face GPT-2 and Llama-family adapters (needs ``transformers``);
- ``adapt``: ``as_unit_chain``, from any of the above to a chain.

Nothing is imported here, so that ``luwu plan`` can read the presets without
loading torch.
"""
