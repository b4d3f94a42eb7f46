"""The CKA kernel of the session's statistics: which one they were computed with (`kernel_of`, `session_kernel`:
reads) and the choice of another (`set_kernel`: changes the analysis options and saves the session)."""

from __future__ import annotations

from layerscope.session.model import Session
from layerscope.stats.analysis import AnalysisOptions, LayerStats
from layerscope.stats.entropy import KERNELS
from layerscope.ui.state import commit


def kernel_of(stats: dict) -> str:
    """The CKA kernel the statistics were computed with (the session's choice when they were computed)."""
    return LayerStats.kernel_of(stats)


def session_kernel(s: Session) -> str:
    """The CKA kernel the session's statistics are (to be) computed with: its analysis options' (AnalysisOptions)."""
    kernel = s.analysis_options.get("kernel", AnalysisOptions().kernel)
    return kernel if kernel in KERNELS else AnalysisOptions().kernel


def set_kernel(s: Session, kernel: str) -> None:
    """Compute the session's statistics with CKA kernel `kernel` from now on: its analysis options change (the
    pages then recompute them through the cached analysis, stats_access.ensure_stats) and the Entropy page's edited options, when
    it has some, take the same kernel, so they do not ask to change it back."""
    if kernel not in KERNELS or kernel == session_kernel(s):
        return
    s.analysis_options = {**s.analysis_options, "kernel": kernel}
    edited = s.view.get("entropy_controls")
    if isinstance(edited, dict) and "kernel" in edited:
        s.view["entropy_controls"] = {**edited, "kernel": kernel}
    commit(s)
