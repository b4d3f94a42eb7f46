"""LayerScope: choose which target-model layers an EAGLE-3 draft reads.

Math lives in `layerscope.metrics`, I/O in `store`, `session`, `prompts`; Streamlit only in `layerscope.ui`.
"""

__version__ = "0.1.0"
