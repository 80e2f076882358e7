"""fairseq-style Transformer translation recipe: ``python -m recipes.transformer.train --preset smoke``.

See docs/recipes.md (presets, commands for one machine and for clusters, parity results).
"""
