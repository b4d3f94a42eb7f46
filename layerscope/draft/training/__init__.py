"""Training a draft: the one loop (fit.py) and its two sources, a capture (train.py) and the target in the loop (online.py)."""
