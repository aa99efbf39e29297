"""The one exception type a user sees: a message and what to do next, never a stack trace."""


class ForgeError(Exception):
    """A user-facing failure. `hint` says what to do next."""

    def __init__(self, message: str, hint: str | None = None, exit_code: int = 2):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.exit_code = exit_code

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message}\n  fix: {self.hint}"
        return self.message
