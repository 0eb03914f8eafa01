"""Checkpoints: the atomic, checksummed format (``format.py``), saving from every rank (``save.py``),
choosing what to resume from (``resume.py``) and exporting state dicts (``export.py``, ``export_hf.py``)."""
