"""fairseq-style Transformer translation recipe: ``python -m recipes.transformer.train --preset smoke``.

See docs/recipes-transformer.md (presets, commands for one machine and for clusters, parity results).
"""
