"""User-facing errors: each names what was wrong and what to do about it."""


class LayerScopeError(Exception):
    """A problem the user can fix. `str(e)` reads "<problem>. <fix>"."""

    def __init__(self, problem: str, fix: str = ""):
        self.problem = problem.rstrip(".")
        self.fix = fix.strip()
        super().__init__(f"{self.problem}. {self.fix}".strip())


class ModelSpecError(LayerScopeError):
    """The model spec could not be resolved or loaded."""


class PromptSetError(LayerScopeError):
    """A prompt set is missing, empty or malformed."""


class CaptureError(LayerScopeError):
    """A capture could not run with the given options."""


class StoreError(LayerScopeError):
    """The artifact store is missing an entry or holds a broken one."""


class SelectionError(LayerScopeError):
    """A layer set or selection request is invalid."""


class DraftError(LayerScopeError):
    """A draft checkpoint is malformed or does not fit the target."""


class SessionError(LayerScopeError):
    """A saved or imported session is corrupted or foreign."""
