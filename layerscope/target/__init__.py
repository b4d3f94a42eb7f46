"""The target model, the one a draft speculates for: how a spec loads (load.py: LoadedModel, load_model, the tiny
random model), the aliases and the packages their GGUF files ship in (aliases.py), GGUF files (gguf.py: assembly of
parts, de-quantization into the store; ggufhead.py: the header alone), the one check of a config before anything is
built (config.py), a file's remembered digest and a stored copy's folder (files.py), the dtype it runs in here
(precision.py), its size before a load (shape.py), its weights without a forward (weights.py), its two ends alone
(ends.py) and how its logits come from its final state (head.py).

Nothing is re-exported here: each name is imported from its own module.
"""
