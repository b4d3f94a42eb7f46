"""LayerScope: choose which target-model layers an EAGLE-3 draft reads.

Math lives in `layerscope.stats`, I/O in `store`, `session`, `prompts`; Streamlit only in `layerscope.ui`.
Importing the package sets the CPU matrix library's code path before anything multiplies (see `blas`).
"""

from layerscope import blas

blas.configure()

__version__ = "0.1.0"
