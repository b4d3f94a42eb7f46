"""The CPU matrix library's one setting LayerScope chooses: MKL's code path, chosen by measurement.

PyTorch's x86 CPU wheels multiply matrices with Intel MKL. Speculative decoding lives on one ratio, the cost
of a forward over T tokens (the verify) against one token (plain decoding); with T = 2..8 every linear layer
multiplies a matrix of 2..8 rows. On an AMD EPYC (Zen 3, AVX2; this project's CI machine) MKL's default
dispatch gives those rows nearly one full pass over the weights each: a 2-token forward of SmolLM2-135M cost
1.64x a 1-token one and 8 tokens 1.88x, so no draft could pay. With MKL's conditional numerical
reproducibility on (`MKL_CBWR=AUTO`: MKL picks the best code path for the CPU and keeps results the same from
run to run) the same forwards cost 1.10x and 1.37x, the 1-token forward itself the same (0.111 s against
0.109 s); break-even tau of a K=1 chain 1.18 against 1.71 (`benchmarks/blas_paths.py --settings
AUTO,AVX2,default --rounds 3`, medians, quiet machine, 2 threads; AVX2 measured like AUTO but would hold back
an AVX-512 CPU). `benchmarks/blas_paths.py` measures every setting on the machine it runs on.

MKL reads MKL_CBWR once, at its first call, so LayerScope sets it when the package is imported, before any
matrix is multiplied in the process (and every process it starts inherits it):

    configure()   MKL_CBWR=AUTO unless the user set MKL_CBWR (kept as given) or LAYERSCOPE_BLAS=default
                  (MKL's own dispatch, untouched); returns describe()
    path()        the MKL_CBWR value in effect ('default' when unset): part of a cost curve's store key
    describe()    'MKL_CBWR=AUTO' / 'MKL_CBWR=COMPATIBLE (yours)' / 'MKL default': what timings ran under,
                  printed on every machine line

A program that multiplied matrices with torch before importing LayerScope keeps MKL's dispatch of that
moment: import layerscope first, or set MKL_CBWR yourself.
"""

from __future__ import annotations

import os

CHOICE = "AUTO"                       # the measured choice (see above)
ENV = "LAYERSCOPE_BLAS"               # "default": leave MKL's dispatch alone
_SET_BY_US = "_LAYERSCOPE_SET_MKL_CBWR"   # marks our own setting, so a child process reports it as ours


def configure() -> str:
    """Set MKL_CBWR=AUTO for this process and its children unless the user chose otherwise; describe()."""
    if os.environ.get(ENV, "").strip().lower() != "default" and "MKL_CBWR" not in os.environ:
        os.environ["MKL_CBWR"] = CHOICE
        os.environ[_SET_BY_US] = CHOICE
    return describe()


def path() -> str:
    """The MKL_CBWR value in effect, 'default' when unset (whoever set it: the code path is the same)."""
    return os.environ.get("MKL_CBWR") or "default"


def describe() -> str:
    """What MKL runs under in this process, in the words every machine line prints."""
    value = os.environ.get("MKL_CBWR")
    if not value:
        return "MKL default"
    return f"MKL_CBWR={value}" if os.environ.get(_SET_BY_US) == value else f"MKL_CBWR={value} (yours)"
