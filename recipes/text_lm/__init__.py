"""A character-level language model on English documentation that ships with Python.

The text is CPython's ``pydoc_data.topics`` (the help topics, about 0.46 M characters), so
the task needs no download. ``data.char_corpus()`` gives a fixed train/valid split,
``model.CharTransformer`` a small causal Transformer; the metric is validation bits per
character. ``benchmarks/accuracy_parity.py`` trains it data-parallel in one process.
"""
